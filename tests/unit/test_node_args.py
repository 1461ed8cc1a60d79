"""``helpers.node_args``, the one place the multi-node tests build a node's layout options: each shape
it gives (static through an endpoint or torchrun's master port, elastic through c10d) is a layout the
command line accepts and reads as meant. Parsing only; no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import node_args
from multigpu.cli.run_args import parse_run_args
from multigpu.config.endpoint import Endpoint
from multigpu.config.run import RunConfig

pytestmark = pytest.mark.usefixtures("no_gpu")


def parse(args: list[str], tmp_path: Path) -> RunConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    config, _ = parse_run_args(["--cpu", "1", *args, str(script)], env={})
    return config


def test_a_static_node_meets_at_the_endpoint(tmp_path: Path) -> None:
    args = node_args(1, endpoint="127.0.0.1:29400")
    assert args == ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29400"]
    config = parse(args, tmp_path)
    assert (config.rdzv.endpoint, config.group_rank, config.world_size) == (
        Endpoint("127.0.0.1", 29400),
        1,
        2,
    )


def test_a_static_node_meets_at_torchruns_master_port(tmp_path: Path) -> None:
    config = parse(node_args(0, 3, master_port=29511), tmp_path)
    assert (config.rdzv.endpoint, config.group_rank, config.world_size) == (
        Endpoint("127.0.0.1", 29511),
        0,
        3,
    )


def test_an_elastic_node_meets_through_c10d_with_or_without_a_rank(tmp_path: Path) -> None:
    args = node_args(None, "1:2", endpoint="127.0.0.1:29400")
    assert args == ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]
    config = parse(args, tmp_path)
    assert (config.rdzv.backend, config.rdzv.min_nodes, config.rdzv.max_nodes) == ("c10d", 1, 2)
    assert "--node-rank" in node_args(1, "2:2", endpoint="127.0.0.1:29400")  # the fault matrix names it
