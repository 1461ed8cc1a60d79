"""torch's debug server in a rank (``--debug-server``). Runs in every rank, from the bootstrap, before
the user's code.

torch 2.13's ``torch.distributed.debug.start_debug_server`` binds every rank's worker server and rank
0's page on every interface ("::" and ""), and publishes each worker under the machine's host name.
Our rule is loopback unless the user asks for more, so the same parts are put together here with the
host the user chose: torch's C++ worker server (``_WorkerServer``, the stacks, flight record and
profiles of this rank) on HOST, its address in the job's store under torch's own keys
(``debug_server/rank<N>``, which torch's page reads), and on rank 0 torch's page in a helper process
(``rank/debug_frontend.py``) on HOST:PORT. A rank whose server cannot start says so in one line and
trains on: the debugging aid is not worth a job.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

from multigpu.contract.names import DEBUG_SERVER_ENV

_KEEP: list[Any] = []
"""The worker server (and rank 0's page process): alive as long as the rank."""


def start_if_asked() -> None:
    raw = os.environ.get(DEBUG_SERVER_ENV)
    if not raw:
        return
    host, port = json.loads(raw)
    try:
        _start(str(host), int(port))
    except Exception as exc:
        print(f"multigpu: rank {os.environ.get('RANK', '?')}: the debug server did not start: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def url_host(host: str) -> str:
    """The host name other processes reach a server bound to ``host`` by."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _start(host: str, port: int) -> None:
    from torch._C._distributed_c10d import _WorkerServer
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    server = _WorkerServer(host, 0)
    _KEEP.append(server)
    store = PrefixStore("debug_server", TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                 is_master=False))
    rank = int(os.environ["RANK"])
    store.set(f"rank{rank}", f"http://{url_host(host)}:{server.port}")
    if rank == 0:
        _KEEP.append(subprocess.Popen([sys.executable, "-m", "multigpu.rank.debug_frontend", host, str(port),
                                       str(os.getpid())], stdin=subprocess.DEVNULL))
