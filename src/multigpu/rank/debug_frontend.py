"""torch's debug-server page, bound where the user chose. Runs in a helper process that rank 0 starts
(``rank/debug_server.py``): ``python -m multigpu.rank.debug_frontend HOST PORT RANK0_PID``.

torch's ``_frontend.main`` serves the page (stacks, flight records, the store, profiles of every rank,
fetched from the ranks' worker servers) on ``("", PORT)``: every interface. The one change made here
is the address its server binds; everything else is torch's. The process holds nothing a user needs:
it dies with rank 0 (``PR_SET_PDEATHSIG``), and the launcher ends rank 0's process group at teardown.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from multigpu.contract.prctl import set_pdeathsig


def main(argv: list[str]) -> None:
    host, port, parent = argv[0], int(argv[1]), int(argv[2])
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # rank 0 died before the line above: nothing to serve
        return
    from torch.distributed.debug import _frontend
    from torch.distributed.debug._debug_handlers import default_handlers

    class BoundServer(_frontend._IPv6HTTPServer):  # type: ignore[misc,name-defined]
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def server_bind(self) -> None:
            self.server_address = (host, self.server_address[1])
            super().server_bind()

    _frontend._IPv6HTTPServer = BoundServer  # type: ignore[misc]
    _frontend.main(port=port, dump_dir=None, dump_interval=60.0, handlers=default_handlers(),
                   enabled_dumps=set(), fetch_timeout=10.0)


if __name__ == "__main__":
    main(sys.argv[1:])
