"""The launcher's guarded c10d store on a real in-process TCPStore: a store that goes away is one typed
error (one line), torch's C++ log lines stay off file descriptor 2, and torch's text reaches the
node's log. In a fresh interpreter, since c10 reads its log level once, when torch is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import clean_env

pytestmark = pytest.mark.integration

SCRIPT = """
    import os, sys
    from datetime import timedelta
    from pathlib import Path
    from multigpu.contract.errors import StoreLostError
    from multigpu.rendezvous.job import JobStore
    from multigpu.rendezvous.failure_sharing import leave_job, outlive_readers
    from multigpu.rendezvous.store import STORE_NOTES, import_torch_quietly

    import_torch_quietly()
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ, "the children would inherit it"
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))
    host = JobStore(server, node=0, base_rank=0, nproc=1, world_size=2)
    node = JobStore(client, node=1, base_rank=1, nproc=1, world_size=2)
    for job in (host, node):
        job.run_id = "r"
        job.store.append(job.key("members"), f"{job.base_rank}:{job.node},")
        job.member = True
    assert outlive_readers(host, timeout_s=0.2) == [1]  # bounded: node 1 has not left
    leave_job(node)
    assert outlive_readers(host, timeout_s=10) == []
    STORE_NOTES.attach(Path(sys.argv[1]))
    del host, server  # the store's host goes away
    try:
        node.read_abort()
    except StoreLostError as exc:
        print(f"lost: {exc}")
    leave_job(node)  # a store that is gone: nothing raised
    print("done")
"""


def test_a_gone_store_is_one_line_and_torchs_words_go_to_the_nodes_log(tmp_path: Path) -> None:
    notes = tmp_path / "store_node1.log"
    env = clean_env()
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(notes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "lost: node 0, the store's host, ended (its launcher was killed?); stopping",
        "done",
    ]
    cxx = [
        line
        for line in done.stderr.splitlines()
        if any(word in line for word in ("TCPStore.cpp", "Exception raised from", ".cpp:", "[c10d]"))
    ]
    assert not cxx, done.stderr[-3000:]
    text = notes.read_text()
    assert "store.check failed: DistNetworkError" in text, text
