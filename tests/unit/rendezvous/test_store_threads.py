"""The launcher's way out with a store thread still inside a call (``rendezvous/store_threads.py``):
it ends with the verdict's code, its atexit handlers run and its buffered output out, without the
interpreter's finalization (under which a C++ store call that returns aborts the process)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from multigpu.rendezvous.store_threads import settle, store_thread

CHILD = """
import atexit, sys, threading
from multigpu.rendezvous import store_threads
atexit.register(lambda: print("atexit ran"))
stuck = threading.Event()
store_threads.store_thread(stuck.wait, "multigpu-test-call").start()
out = open(sys.argv[1], "w")
out.write("buffered record")  # never flushed by the child itself
print("buffered line", end="")
code = store_threads.leave(7, timeout_s=0.2)
print("leave returned", code)
"""


def test_leaving_with_a_store_thread_still_in_a_call_keeps_the_code_and_loses_nothing(
    tmp_path: Path,
) -> None:
    record = tmp_path / "record.txt"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(record)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 7, done.stderr
    assert done.stdout == "buffered lineatexit ran\n", done.stdout
    assert record.read_text() == "buffered record"


def test_leaving_after_the_store_threads_returned_is_an_ordinary_exit() -> None:
    from multigpu.rendezvous.store_threads import leave

    release = threading.Event()
    thread = store_thread(release.wait, "multigpu-test-call")
    thread.start()
    release.set()
    assert settle(timeout_s=10.0) == [] and not thread.is_alive()
    assert leave(5, timeout_s=10.0) == 5
