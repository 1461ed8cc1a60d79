"""Rank layout over nodes and SLURM detection, from recorded SLURM environments."""

from __future__ import annotations

import pytest

from multigpu.cli.run_args import parse_run_args
from multigpu.cluster.slurm import detect, expand_nodelist
from multigpu.config.endpoint import Endpoint
from multigpu.contract.errors import UsageError

# Recorded from `srun --nodes=4 --ntasks-per-node=1 env` on a SLURM 23 cluster (trimmed).
SRUN_NODE2 = {
    "SLURM_JOB_ID": "481516",
    "SLURM_JOB_NODELIST": "gpu[01-03,07]",
    "SLURM_STEP_NODELIST": "gpu[01-03,07]",
    "SLURM_NNODES": "4",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_STEP_ID": "0",
}
# The batch script itself (sbatch, no srun step): not one launcher per node.
SBATCH_SHELL = {
    "SLURM_JOB_ID": "481516",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
}


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
    ],
)
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


def test_detect_srun_step() -> None:
    found = detect(SRUN_NODE2)
    assert found is not None
    assert (found.master_host, found.node_rank, found.nnodes, found.job_id) == ("gpu01", 2, 4, "481516")


def test_detect_ignores_the_batch_shell_and_several_tasks_per_node() -> None:
    assert detect(SBATCH_SHELL) is None
    assert detect({**SRUN_NODE2, "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16"}) is None
    assert detect({}) is None


def _parse(tmp_path, args, env):  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    config, _ = parse_run_args([*args, str(script)], env=env)
    return config


def test_slurm_fills_the_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = _parse(tmp_path, ["--cpu", "2"], SRUN_NODE2)
    assert config.rdzv.endpoint == Endpoint("gpu01", 29500)
    assert (config.base_rank, config.world_size, config.node_rank, config.nnodes) == (4, 8, 2, 4)
    assert config.output.run_id == "slurm-481516"
    assert config.group_rank == 2 and config.group_world_size == 4


def test_explicit_options_win_over_slurm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**SRUN_NODE2, "MASTER_PORT": "4000"}
    config = _parse(tmp_path, ["--cpu", "2", "--rdzv-endpoint", "head:5000", "--run-id", "mine"], env)
    assert config.rdzv.endpoint == Endpoint("head", 5000) and config.output.run_id == "mine"
    assert _parse(tmp_path, ["--cpu", "2"], env).rdzv.endpoint == Endpoint("gpu01", 4000)
    explicit = _parse(tmp_path, ["--cpu", "2", "--base-rank", "0", "--world-size", "2"], env)
    assert (explicit.base_rank, explicit.world_size, explicit.multi_node) == (0, 2, False)


def test_nnodes_maps_onto_base_rank_and_world_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = _parse(
        tmp_path,
        ["--cpu", "3", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29400"],
        {},
    )
    assert (config.base_rank, config.world_size, config.group_rank, config.multi_node) == (3, 6, 1, True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2", "--node-rank", "1", "--base-rank", "0", "--rdzv-endpoint", "h:1"], "disagrees"),
        (["--nnodes", "2", "--node-rank", "1", "--world-size", "5", "--rdzv-endpoint", "h:1"], "disagrees"),
        (["--base-rank", "-1"], "at least 0"),
        (["--world-size", "abc"], "must be an integer"),
    ],
)
def test_layout_mistakes(tmp_path, args, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match=message):
        _parse(tmp_path, ["--cpu", "2", *args], {})
