"""``--no-python``: a program that is not Python keeps the launcher's guarantees."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import assert_gone, pids_in, run_cli, start_cli, wait_for_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_exit_code_and_output_of_the_program(tmp_path: Path) -> None:
    result = run_cli(
        [
            "run",
            "--status",
            "off",
            "--no-python",
            "--nproc-per-node",
            "2",
            "sh",
            "-c",
            'echo "rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE"; touch "done$RANK"; '
            '[ "$RANK" = 0 ] && exit 0; while [ ! -f done0 ]; do sleep 0.05; done; exit 3',
        ],
        tmp_path,
        timeout=60,
    )
    assert "rank=0 local=0 world=2" in result.stdout and "rank=1 local=1 world=2" in result.stdout
    assert result.returncode == 3, result.stderr
    assert "rank 1" in result.stderr and "exit" in result.stderr


def test_a_program_killed_by_a_signal_is_reported_as_such(tmp_path: Path) -> None:
    result = run_cli(
        ["run", "--status", "off", "--no-python", "sh", "-c", "kill -SEGV $$"], tmp_path, timeout=60
    )
    assert result.returncode == 128 + signal.SIGSEGV, result.stderr
    assert "SIGSEGV" in result.stderr


def test_nothing_is_left_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """The program and a child it started both go, within moments of the launcher's SIGKILL."""
    out = tmp_path / "pids.txt"
    launcher = start_cli(
        [
            "run",
            "--status",
            "off",
            "--no-python",
            "--nproc-per-node",
            "2",
            "sh",
            "-c",
            f'sleep 300 & echo "pid=$$ pid=$!" >> {out}; wait',
        ],
        tmp_path,
    )
    try:
        wait_for_lines(out, r"pid=\d+ pid=\d+", 2, timeout=60)
        pids = pids_in(out.read_text())
        assert len(pids) == 4
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        assert_gone(pids, timeout=5)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate(timeout=10)


def test_sigterm_reaches_the_program_which_may_exit_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "ready.txt"
    launcher = start_cli(
        [
            "run",
            "--status",
            "off",
            "--no-python",
            "sh",
            "-c",
            f"trap 'echo cleaned; exit 0' TERM; echo pid=$$ >> {out}; while true; do sleep 0.1; done",
        ],
        tmp_path,
    )
    try:
        wait_for_lines(out, r"pid=\d+", 1, timeout=60)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=10)
    assert "cleaned" in stdout, stderr
    assert launcher.returncode == 128 + signal.SIGTERM
    assert_gone(pids_in(out.read_text()))


def test_a_missing_program_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli(["run", "--no-python", "no-such-program-xyz"], tmp_path, timeout=30)
    assert result.returncode == 2 and "not found or not executable" in result.stderr
    assert subprocess.run(["true"]).returncode == 0
