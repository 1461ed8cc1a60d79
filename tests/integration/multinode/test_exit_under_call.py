"""A launcher that leaves while a thread of its own is still inside a store call (issue 41: on a slow
link a launcher once died of "terminate called without an active exception", SIGABRT, exit -6).

The store (``multigpu store``) is stopped with SIGSTOP while the job runs: its socket still takes
bytes, so the launcher's store calls wait with no answer, as over a dead link; the launcher names the
lost store and leaves. Its last atexit handler (the first registered: run by the test's driver
before the launcher's own code) lets the store go on, so the stuck calls are answered while the
interpreter finalizes: before the fix that aborted the launcher. The exit code must be the job's
verdict, with no C++ line and nothing left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, free_port, node_args, pids_in, write_script
from integration.multinode.test_store_command import store_process

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.matrix, pytest.mark.timeout(90)]

SLEEPER = """
    import os, time
    print(f"pid={os.getpid()}", flush=True)
    open("started", "w").close()
    time.sleep(120)
"""

DRIVER = """
import atexit, os, signal, sys
atexit.register(os.kill, int(os.environ["STOPPED_STORE"]), signal.SIGCONT)  # runs last
from multigpu.cli.entry import main
sys.exit(main())
"""


def test_a_launcher_leaving_during_a_store_call_exits_with_its_verdict(tmp_path: Path) -> None:
    write_script(tmp_path, "sleeper.py", SLEEPER)
    port = free_port()
    store = store_process(port, tmp_path)
    layout = [
        *node_args(None, "1:2", endpoint=f"127.0.0.1:{port}"),
        "--rdzv-conf",
        "is_host=false,last_call_timeout=1",
    ]
    launcher = subprocess.Popen(
        [PYTHON, "-c", DRIVER, "run", *layout, "--nproc-per-node", "1", "sleeper.py"],
        cwd=tmp_path,
        env=clean_env({"STOPPED_STORE": str(store.pid)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and launcher.poll() is None:
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.05)
        store.send_signal(signal.SIGSTOP)  # every store call from now on waits
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        os.kill(store.pid, signal.SIGCONT)
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=10)
    assert "terminate called" not in err and launcher.returncode == 1, (launcher.returncode, err[-3000:])
    assert "the rendezvous store stopped answering" in err, err[-3000:]
    assert_gone([*pids_in(out), store.pid])
