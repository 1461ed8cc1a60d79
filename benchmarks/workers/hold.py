"""Every rank starts a grandchild (``sleep 300``), marks itself ready once the group is up, then sleeps.

usage: hold.py SECONDS [--no-child]
Used for the launcher-killed, signal and idle-overhead benchmarks.
"""

from __future__ import annotations

import subprocess
import sys
import time

from _bench import init_gloo, mark, record_pid

seconds = float(sys.argv[1])
record_pid()
child = None
if "--no-child" not in sys.argv:
    child = subprocess.Popen(["sleep", "300"])
    record_pid(child.pid, "grandchild")
dist = init_gloo()
dist.barrier()
mark("ready")
try:
    time.sleep(seconds)
finally:
    if child is not None:
        child.kill()
        child.wait()
dist.destroy_process_group()
