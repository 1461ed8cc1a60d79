"""The check process's parts (``preflight/check.py``), in the test's process or as their own: a timed
matmul, and a whole check of a one-node group over a real c10d store, its task in and its result out in
the one wire format (``contract/preflight_wire.py``, whose round trips are tested beside it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from multigpu.contract.preflight_wire import PreflightResult, PreflightTask
from multigpu.preflight.check import main, matmul_gflops

pytestmark = pytest.mark.timeout(120)


def task(port: int, **changes: object) -> PreflightTask:
    fields: dict[str, object] = {
        "host": "127.0.0.1",
        "port": port,
        "prefix": "multigpu/test/preflight/0/",
        "node": 0,
        "nodes": 1,
        "device": "cpu",
        "timeout_s": 30.0,
        "launcher": os.getpid(),
    }
    return PreflightTask(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_check_reads_the_task_the_launcher_encodes() -> None:
    one = task(1234, node=1, nodes=3)
    assert PreflightTask.decode(one.encode()) == one


def test_the_matmul_runs_for_the_time_asked_and_gives_a_rate() -> None:
    assert matmul_gflops("cpu", seconds=0.05) > 0


ONE_NODE = """
    import json, os, subprocess, sys
    from datetime import timedelta
    from torch.distributed import TCPStore
    from multigpu.contract.preflight_wire import PreflightTask

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    task = PreflightTask("127.0.0.1", store.port, "multigpu/r/preflight/0/", 0, 1, "cpu", 30.0, os.getpid())
    argv = [sys.executable, "-m", "multigpu.preflight", task.encode()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)
    print(json.dumps({"code": done.returncode, "out": done.stdout, "err": done.stderr,
                      "keys": store.num_keys()}))
"""


def test_a_one_node_check_over_the_store_gives_both_figures_under_its_prefix() -> None:
    """``python -m multigpu.preflight`` itself, beside a c10d store (in a process of their own: a store
    in this one would keep its descriptors)."""
    argv = [sys.executable, "-c", textwrap.dedent(ONE_NODE)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=110, check=True)
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert outcome["code"] == 0, outcome["err"]
    result = PreflightResult.decode(outcome["out"])
    [figures] = result.figures
    assert figures.matmul_gflops > 0 and figures.all_reduce_gbps > 0 and result.seconds > 0
    assert outcome["keys"] > 0  # the group met through the job's store


def test_a_check_not_started_by_its_launcher_does_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([task(1, launcher=1).encode()]) == 1  # pid 1 is not our parent
    assert capsys.readouterr().out == ""


def test_a_failed_check_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["{not json"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("JSONDecodeError: ") and err.count("\n") == 1
