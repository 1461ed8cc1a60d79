"""A training loop that calls ``multigpu.heartbeat()``: silent steps still count as progress."""

import time

import multigpu

for _step in range(8):
    time.sleep(1.0)  # a long, silent step (no output)
    multigpu.heartbeat()  # tells the launcher this rank is alive; does nothing outside multigpu
print("finished 8 silent steps")
