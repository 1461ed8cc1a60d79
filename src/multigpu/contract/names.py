"""The names of multigpu's own environment variables between the launcher and its ranks, and the two
formats they need (a cpulist; ``--debug-server``'s HOST, PORT and token).

Read by the rank (its bootstrap, ``multigpu.heartbeat``, the preemption API), written by the
launcher's environment builder (``environment.py``) and by function mode's caller. Standard library
only, and cheap to import: every fresh rank imports it before the user's code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

# multigpu's own variables, between the launcher (or the caller, in function mode) and its ranks.
RUN_ID_ENV = "MULTIGPU_RUN_ID"
OUTPUT_DIR_ENV = "MULTIGPU_OUTPUT_DIR"
LAUNCHER_PID_ENV = "MULTIGPU_LAUNCHER_PID"
"""The process whose death ends the rank (``rank/guard.py``)."""
ERROR_FILE_ENV = "MULTIGPU_ERROR_FILE"
"""Where the rank's bootstrap writes its ``WorkerFailure`` record."""
SENTINEL_ENV = "MULTIGPU_NODE_SENTINEL"
"""Set when the node's sentinel (``rank/sentinel.py``) watches the rank: the rank then forks no
sentinel of its own (``rank/guard.py``), and takes the variable out before user code runs."""
HEARTBEAT_FD_ENV = "MULTIGPU_HEARTBEAT_FD"
"""The rank's end of its beat pipe (``contract/beats.py``)."""
DEVICE_ENV = "MULTIGPU_DEVICE"
NODE_RANK_ENV = "MULTIGPU_NODE_RANK"
ATTEMPT_ENV = "MULTIGPU_ATTEMPT"
ANNOUNCE_ENV = "MULTIGPU_ANNOUNCE_FAILURE"
"""Function mode: a failing rank says so on its beat pipe at once ("1")."""
FR_DUMP_ENV = "MULTIGPU_FR_DUMP"
"""Set: the bootstrap arms the thread that answers ``FR_SIGNAL`` (stacks, then the flight record);
its value is where the flight record goes, empty when the recorder is off."""
AFFINITY_ENV = "MULTIGPU_CPU_AFFINITY"
"""``--numa-binding``: the CPUs the bootstrap binds the rank to (a cpulist, ``0-3,8``)."""
WARNING_SIGNALS_ENV = "MULTIGPU_WARNING_SIGNALS"
"""Comma-separated signal names the launcher treats as a preemption warning, e.g. ``SIGUSR1,SIGUSR2``."""
DEBUG_SERVER_ENV = "MULTIGPU_RANK_DEBUG_SERVER"
"""``--debug-server``: HOST, PORT and the run's token, as JSON; every rank serves its worker side on HOST
and rank 0 starts the page on PORT, each wanting the token (``rank/debug_server.py``)."""
DEBUG_TOKEN_ENV = "MULTIGPU_DEBUG_TOKEN"
"""``--debug-server``: the run's token, set by the user, the same on every node (the page signs its
requests to every node's ranks with it); unset, each launcher makes its own."""
DEBUG_SOCKETS_ENV = "MULTIGPU_DEBUG_SOCKETS"
"""``--debug-server``: the launcher's private folder (0700) where each rank makes its worker server's
socket folder; the launcher removes it as the run ends, whatever became of the ranks."""
RESUMED_ENV = "MULTIGPU_RESUMED"
PREVIOUS_OUTPUT_ENV = "MULTIGPU_PREVIOUS_OUTPUT"


def debug_server_settings(env: Mapping[str, str]) -> tuple[str, int, str] | None:
    """HOST, PORT and the run's token from ``DEBUG_SERVER_ENV`` in ``env``; None without one."""
    raw = env.get(DEBUG_SERVER_ENV)
    if not raw:
        return None
    host, port, token = json.loads(raw)
    return str(host), int(port), str(token)


def parse_cpulist(text: str) -> list[int]:
    """The kernel's ``0-3,8,10-11`` format."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def format_cpulist(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
