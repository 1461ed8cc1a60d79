"""A rank's detached descendants go with its launch, not with the caller.

``multigpu.launch``'s launcher stays warm and serves launch after launch (``function/launcher.py``);
what a launch's ranks started and left running (a daemon: fork, setsid, fork, with or without an
``exec``) must end when that launch ends, while the caller and its warm launcher go on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, alive, clean_env, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DETACH = """
    import json, os, pathlib, sys, time
    import multigpu

    def detach(kind):
        if os.environ["RANK"] != "1":
            return None
        if os.fork() == 0:  # the classic daemon: fork, setsid, fork
            os.setsid()
            if os.fork():
                os._exit(0)
            pathlib.Path(f"{kind}.tmp").write_text(str(os.getpid()))
            os.rename(f"{kind}.tmp", f"{kind}.pid")
            if kind == "exec":
                os.execvp("sleep", ["sleep", "60"])
            time.sleep(60)
            os._exit(0)
        while not os.path.exists(f"{kind}.pid"):
            time.sleep(0.01)
        return int(pathlib.Path(f"{kind}.pid").read_text())

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
        except OSError:
            return False

    out = {}
    for kind in ("exec", "fork"):
        pid = multigpu.launch(detach, kind, nprocs=2, device="cpu")[1]
        deadline = time.monotonic() + 2.0
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        out[kind] = {"pid": pid, "alive_after_launch": alive(pid)}
    multigpu.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_ranks_daemon_ends_with_its_launch(tmp_path: Path) -> None:
    """Each launch's daemon is gone (within 2 s) once ``launch`` returned, the launcher still warm."""
    script = write_script(tmp_path, "detach.py", DETACH)
    proc = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    pids = [out[kind]["pid"] for kind in ("exec", "fork")]
    left = [pid for pid in pids if alive(pid)]  # the caller has exited: anything left is an orphan now
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert {kind: out[kind]["alive_after_launch"] for kind in out} == {"exec": False, "fork": False}
    assert not left
