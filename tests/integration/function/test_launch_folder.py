"""A launch's private folder (its request holds the caller's whole environment) never outlives its
caller: a caller killed mid-launch by SIGKILL or SIGTERM leaves no ``multigpu-launch-*`` folder, and the
launcher's keeper that removed it is gone too, as it is after a launch that ended normally. The caller
runs in a fresh interpreter with a temporary folder of its own (``TMPDIR``)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from helpers import PYTHON, assert_gone, clean_env, write_script

pytestmark = pytest.mark.integration

HOLD = """
    import os, sys, time
    import multigpu

    def hold():
        mark = f"started_{os.environ['RANK']}"
        with open(mark + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(mark + ".part", mark)
        time.sleep(300)

    def ok():
        return 1

    if sys.argv[1] == "hold":
        multigpu.launch(hold, nprocs=2, device="cpu")
    else:
        assert multigpu.launch(ok, nprocs=2, device="cpu") == [1, 1]
        multigpu.shutdown()
        print("RESULT done", flush=True)
"""


def _until(condition: Callable[[], bool], timeout: float) -> bool:
    """Whether ``condition`` came true within ``timeout`` seconds (looked at every 50 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _keepers(temp: Path) -> list[int]:
    """The launcher processes (and keepers, forked from them) started for callers using ``temp``."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "multigpu.function.launcher" in cmdline and str(temp) in cmdline:
            found.append(process.pid)
    return found


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    temp, work = tmp_path / "tmp", tmp_path / "work"
    temp.mkdir()
    work.mkdir()
    script = write_script(tmp_path, "caller.py", HOLD)
    env = clean_env({"TMPDIR": str(temp), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    with open(tmp_path / "caller.err", "wb") as err:
        proc = subprocess.Popen(
            [PYTHON, str(script), mode], cwd=work, env=env, stdout=subprocess.PIPE, stderr=err
        )
    return proc, temp, work


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_caller_killed_mid_launch_leaves_no_private_folder(tmp_path: Path, sig: signal.Signals) -> None:
    proc, temp, work = _start(tmp_path, "hold")
    marks = [work / "started_0", work / "started_1"]
    try:
        assert _until(lambda: all(m.exists() for m in marks), 120), (tmp_path / "caller.err").read_text()
        (folder,) = temp.glob("multigpu-launch-*")
        assert (folder / "request.pkl").is_file()  # the caller's environment, while it runs
        ranks = [int(m.read_text()) for m in marks]
        proc.send_signal(sig)
        assert proc.wait(30) == -sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert _until(lambda: not list(temp.glob("multigpu-launch-*")), 30), list(folder.iterdir())
    assert_gone(ranks, timeout=30)
    assert _until(lambda: not _keepers(temp), 30), _keepers(temp)


def test_a_launch_that_ended_leaves_no_folder_and_no_keeper(tmp_path: Path) -> None:
    proc, temp, _ = _start(tmp_path, "ok")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0 and b"RESULT done" in out, (tmp_path / "caller.err").read_text()
    assert list(temp.glob("multigpu-launch-*")) == []
    assert _until(lambda: not _keepers(temp), 30), _keepers(temp)
