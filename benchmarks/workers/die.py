"""One rank dies after the group is up; the others sleep (the launcher must end them).

usage: die.py {exit|raise|kill|grandchild} [DYING_RANK]
The dying rank writes time.time() to marks/death.<rank> right before it dies. ``grandchild``: the
dying rank first starts a DataLoader-style child that inherits its stdout and stderr (and so keeps
the launcher's pipes open after the rank is gone), then raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from _bench import init_gloo, mark, rank, record_pid

mode = sys.argv[1]
dying = int(sys.argv[2]) if len(sys.argv) > 2 else 1
record_pid()
dist = init_gloo()
dist.barrier()
if rank() != dying:
    time.sleep(60)
    sys.exit(0)
if mode == "grandchild":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    record_pid(child.pid, "grandchild")
mark("death")
if mode == "exit":
    os._exit(3)
elif mode in ("raise", "grandchild"):
    raise RuntimeError("benchmark: this rank dies by raising")
elif mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(f"die.py: unknown mode {mode!r}")
