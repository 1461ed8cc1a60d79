"""The node's sentinel (``rank/sentinel.py``), driven by a stand-in launcher: a small Python process
that starts it, hands it a stopped "rank" (a ``sleep`` in its own session, with a child of its own)
and is then SIGKILLed, or closes the sentinel as a finished run does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, pids_in

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LAUNCHER = """
import os, signal, subprocess, sys
from multigpu.runner.sentinel_handle import NodeSentinel
sentinel = NodeSentinel()
rank = subprocess.Popen(["bash", "-c", "sleep 60 & echo child=$!; wait"], stdout=subprocess.PIPE,
                        start_new_session=True, text=True)
child = rank.stdout.readline().strip()
os.kill(rank.pid, signal.SIGSTOP)  # a rank that cannot run its own guard
assert sentinel.watch(rank.pid, os.pidfd_open(rank.pid))
print(f"sentinel={sentinel.pid} rank={rank.pid} {child}", flush=True)
if sys.argv[1] == "close":
    sentinel.close()
    os.kill(rank.pid, signal.SIGKILL)  # as the launcher's teardown does, before it closes the sentinel
    rank.wait()
    print("closed", flush=True)
sys.stdin.read()  # until the test ends this launcher
"""


def start_launcher(tmp_path: Path, how: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen(
        [PYTHON, str(script), how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env()
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    pids = {label: pids_in(line, label)[0] for label in ("sentinel", "rank", "child")}
    return proc, pids


def test_the_launcher_dying_ends_a_stopped_rank_and_its_child(tmp_path: Path) -> None:
    proc, pids = start_launcher(tmp_path, "die")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert_gone([pids["rank"], pids["child"], pids["sentinel"]], timeout=5)
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_closing_the_sentinel_ends_and_reaps_it_and_leaves_the_ranks_to_the_launcher(tmp_path: Path) -> None:
    proc, pids = start_launcher(tmp_path, "close")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "closed"
        assert_gone([pids["sentinel"]], timeout=5)
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert_gone([pids["rank"]], timeout=5)
    with contextlib.suppress(ProcessLookupError):  # the rank's child, orphaned: ours to end
        os.kill(pids["child"], signal.SIGKILL)
    assert_gone([pids["child"]], timeout=5)
