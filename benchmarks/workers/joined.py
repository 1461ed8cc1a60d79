"""Start and restart timing: marks ``joined<attempt>`` once past init_process_group, then a barrier.

usage: joined.py [fail]
With ``fail``, rank 1 of attempt 0 marks ``failed`` and dies right after joining; its peers' barrier
then fails, and the launcher's restart brings attempt 1, whose ``joined1`` marks end the measurement.
"""

from __future__ import annotations

import os
import sys

from _bench import init_gloo, mark, mark_start_phases, record_pid

mark_start_phases()
record_pid()
dist = init_gloo()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
mark(f"joined{attempt}")
if sys.argv[1:] == ["fail"] and attempt == 0 and dist.get_rank() == 1:
    mark("failed")
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
