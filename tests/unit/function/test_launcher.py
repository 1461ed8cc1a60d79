"""The launcher's loop over launch requests: what fails before a launch is one line, never a traceback."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from multigpu.function import launcher


def test_an_unreadable_request_or_a_gone_working_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert launcher.serve_one(str(tmp_path / "missing.pkl").encode()) == 2
    request = tmp_path / "request.pkl"
    gone = {"config": None, "env": dict(os.environ), "cwd": str(tmp_path / "gone")}
    request.write_bytes(pickle.dumps(gone))
    assert launcher.serve_one(str(request).encode()) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "missing.pkl" in err[0] and "gone" in err[1], err
    assert all(line.startswith("multigpu: ") for line in err)


INTERRUPTED = """
    import os, pickle, sys
    import multigpu.runner.attempts as attempts
    import multigpu.template.process as process
    from multigpu.function import launcher

    def interrupted(config, env):
        raise KeyboardInterrupt  # as a Ctrl-C forwarded before the launch's handlers are installed

    attempts.launch = interrupted
    process.start_early = process.close_early = process.keep_warm = lambda *a: None
    launcher.main([str(os.getppid()), "1"])  # guarded by the test process, alive throughout
"""


def test_a_ctrl_c_outside_the_launchs_handling_is_one_line_and_sigint(tmp_path: Path) -> None:
    request = tmp_path / "request.pkl"
    request.write_bytes(pickle.dumps({"config": None, "env": dict(os.environ), "cwd": str(tmp_path)}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INTERRUPTED)],
        input=f"{request}\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert proc.stderr.splitlines() == ["multigpu: interrupted (SIGINT)"], proc.stderr
