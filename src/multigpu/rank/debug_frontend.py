"""torch's debug-server page, bound where the user chose. Runs in a helper process that rank 0 starts
(``rank/debug_server.py``): ``python -m multigpu.rank.debug_frontend HOST PORT RANK0_PID``.

torch's ``_frontend.main`` serves the page (stacks, flight records, the store, profiles of every rank,
fetched from the ranks' worker servers) on ``("", PORT)``: every interface, to anyone. Two changes are
made here: its server binds HOST, and it answers only a browser that brings the run's token (from the
rank's environment, never the command line, which every user can read): ``/?token=TOKEN`` once, which
leaves a cookie for the page's other links, or the cookie itself. Everything else is torch's. The
process holds nothing a user needs: it dies with rank 0 (``PR_SET_PDEATHSIG``), and the launcher ends
rank 0's process group at teardown.
"""

from __future__ import annotations

import hmac
import os
import signal
import socket
import sys
from http.cookies import SimpleCookie
from typing import Any

from multigpu.contract.names import debug_server_settings
from multigpu.contract.prctl import set_pdeathsig

COOKIE = "multigpu_debug_token"


def admitted(token: str, query: str | None, cookie_header: str) -> bool:
    """Whether a request brings ``token``, in its query (``?token=``) or its cookie."""
    cookie = SimpleCookie()
    cookie.load(cookie_header)
    given = query if query is not None else cookie[COOKIE].value if COOKIE in cookie else ""
    return hmac.compare_digest(given.encode(), token.encode())


def guard(frontend: Any, token: str) -> None:
    """Wrap torch's request handling in ``frontend`` (its module) with the token check."""
    handle = frontend.FrontendServer._handle_request
    end_headers = frontend.HTTPRequestHandler.end_headers

    def guarded(self: Any, req: Any) -> None:
        query = req.get_query_arg("token")
        if not admitted(token, query, req.headers.get("Cookie", "")):
            req.send_error(
                403,
                "this debug page wants the run's token: open the address its launcher "
                "printed (it ends in ?token=...)",
            )
            return
        req.multigpu_set_cookie = query is not None
        handle(self, req)

    def with_cookie(req: Any) -> None:
        if getattr(req, "multigpu_set_cookie", False):
            req.send_header("Set-Cookie", f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/")
        end_headers(req)

    frontend.FrontendServer._handle_request = guarded
    frontend.HTTPRequestHandler.end_headers = with_cookie


def main(argv: list[str]) -> None:
    host, port, parent = argv[0], int(argv[1]), int(argv[2])
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # rank 0 died before the line above: nothing to serve
        return
    asked = debug_server_settings(os.environ)
    if asked is None:  # started by hand, without the rank's environment: nothing to guard with
        return
    from torch.distributed.debug import _frontend
    from torch.distributed.debug._debug_handlers import default_handlers

    guard(_frontend, asked[2])

    class BoundServer(_frontend._IPv6HTTPServer):  # type: ignore[misc,name-defined]
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def server_bind(self) -> None:
            self.server_address = (host, self.server_address[1])
            super().server_bind()

    _frontend._IPv6HTTPServer = BoundServer  # type: ignore[misc]
    _frontend.main(
        port=port,
        dump_dir=None,
        dump_interval=60.0,
        handlers=default_handlers(),
        enabled_dumps=set(),
        fetch_timeout=10.0,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
