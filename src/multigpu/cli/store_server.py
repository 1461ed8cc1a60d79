"""``multigpu store HOST:PORT``: the rendezvous store of elastic jobs, served off the training nodes.

Runs in its own process, on any machine the nodes reach (a login node, a small CPU pod). It serves
torch's own ``TCPStore``, the store torch's c10d rendezvous uses, so that no training node is the one
whose loss ends the job: with its store on node 0 (torchrun's default, and ours) a job cannot outlive
node 0. Jobs reach it with torchrun's own line (``--rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-conf is_host=false``); every key multigpu writes lives under the job's ``--rdzv-id``, as
torch's rendezvous keys do, so one store serves job after job.

The store's threads run with the stop signals blocked; the main thread waits for one with
``sigwait`` and ends the process: nothing a user needs is held here once it is told to stop. The store
is unauthenticated, like every TCPStore: it listens only on the address given (never every interface
unless that address is 0.0.0.0), on a network the jobs trust.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from multigpu.config.endpoint import parse_endpoint
from multigpu.contract.signals import signal_name
from multigpu.rendezvous.store import bind_store_socket, serve_store_on

STOP = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

USAGE = """usage: multigpu store [-h] HOST:PORT

Serve the rendezvous store of elastic jobs from this machine, so that no training node is a single
point of failure. Each node of a job then runs:

  multigpu run --nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
      --rdzv-conf is_host=false --rdzv-id JOB ... train.py

One store serves job after job (their keys live under each --rdzv-id). It is unauthenticated, like
every torch store: it listens on HOST only; keep it on a network the jobs trust. Ctrl-C ends it.
"""


def cmd_store(argv: Sequence[str]) -> int:
    from multigpu.contract.errors import UsageError

    if any(a in ("-h", "--help") for a in argv):
        print(USAGE, end="")
        return 0
    if len(argv) != 1:
        raise UsageError("give the address to serve on, HOST:PORT (e.g. multigpu store 10.0.0.5:29400)")
    _, colon, port = argv[0].strip().rpartition(":")
    if not colon or port.endswith("]"):  # "10.0.0.5", "[::1]": parse_endpoint's hint, port 0, is no use
        raise UsageError(
            f"multigpu store {argv[0]!r} has no port: write HOST:PORT with the fixed port the jobs name "
            "in --rdzv-endpoint (e.g. multigpu store 10.0.0.5:29400)"
        )
    endpoint = parse_endpoint(argv[0], option="multigpu store")
    if endpoint.port == 0:
        raise UsageError("multigpu store needs a fixed port: the jobs name it in --rdzv-endpoint")
    sock = bind_store_socket(endpoint)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP)  # the store's threads inherit the block
    store = serve_store_on(sock, endpoint.bind_host)
    print(
        f"multigpu: store: serving the rendezvous store at {endpoint} (jobs: --rdzv-backend c10d "
        f"--rdzv-endpoint {endpoint} --rdzv-conf is_host=false); unauthenticated, so only on a trusted "
        "network; Ctrl-C ends it",
        file=sys.stderr,
        flush=True,
    )
    sig = signal.sigwait(STOP)
    print(
        f"multigpu: store: {signal_name(sig)} received; stopped ({store.num_keys()} keys dropped)",
        file=sys.stderr,
        flush=True,
    )
    return 0
