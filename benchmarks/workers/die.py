"""One rank dies after the group is up; the others sleep (the launcher must end them).

usage: die.py {exit|raise|kill} [DYING_RANK]
The dying rank writes time.time() to marks/death.<rank> right before it dies.
"""

from __future__ import annotations

import os
import signal
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
mark("death")
if mode == "exit":
    os._exit(3)
elif mode == "raise":
    raise RuntimeError("benchmark: this rank dies by raising")
elif mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(f"die.py: unknown mode {mode!r}")
