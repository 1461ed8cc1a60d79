"""torch's debug-server page, bound where the user chose. Runs in a helper process that rank 0 starts
(``rank/debug_server.py``): ``python -m multigpu.rank.debug_frontend HOST PORT RANK0_PID``.

torch's ``_frontend.main`` serves the page (stacks, flight records, the store, profiles of every rank,
fetched from the ranks' worker servers) on ``("", PORT)``: every interface, to anyone. Here its server
binds HOST, and it answers only a browser that brings the run's token (from the
rank's environment, never the command line, which every user can read): ``/?token=TOKEN`` once, which
leaves a cookie for the page's other links, or the cookie itself. The token goes no further: the
ranks' addresses it fetches from (read from the job's store, which every user can read and write)
hold none, and each request to a rank's proxy is signed for that address instead
(``debug_server.sign``), so an address another user planted receives nothing it can use elsewhere; the
page shows a reply only when the proxy proved it holds the token (``debug_server.reply_mac``), and
escapes everything it did not make itself (torch's templates do not), so a planted address or store key
cannot put its own script in the owner's page; the request log (torch's, on rank 0's log) shows
``token=...``, never the token. Everything else is torch's. The process holds nothing a user needs: it
dies with rank 0 (``PR_SET_PDEATHSIG``), and the launcher ends rank 0's process group at teardown.
"""

from __future__ import annotations

import hmac
import http.client
import os
import re
import signal
import socket
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlsplit

from multigpu.contract.names import debug_server_settings
from multigpu.contract.prctl import set_pdeathsig
from multigpu.rank.debug_server import REPLY_HEADER, reply_mac, sign

COOKIE = "multigpu_debug_token"
UNPROVEN = (
    "answered, but not as this run's rank: its address in the job's store is not its server's "
    "(another user's?), so nothing it sent is shown"
)


def admitted(token: str, query: str | None, cookie_header: str) -> bool:
    """Whether a request brings ``token``, in its query (``?token=``) or its cookie."""
    cookie = SimpleCookie()
    cookie.load(cookie_header)
    given = query if query is not None else cookie[COOKIE].value if COOKIE in cookie else ""
    return hmac.compare_digest(given.encode(), token.encode())


def redact(text: str, token: str) -> str:
    """``text`` (a request line, a log message) with the token's value left out."""
    return re.sub(r"([?&;]token=)[^&;\s\"]*", r"\1...", text).replace(token, "...")


def fetch(token: str, urls: list[str], timeout: float) -> list[tuple[int, str]]:
    """What each rank's address answers (status, text), as torch's ``fetch_all`` wants it: every
    request signed for its address, and a 200 kept only when the proxy proved it holds the token."""
    with ThreadPoolExecutor(max_workers=20) as pool:
        return list(pool.map(lambda url: fetch_one(token, url, timeout), urls))


def fetch_one(token: str, url: str, timeout: float) -> tuple[int, str]:
    """One rank's answer to ``url`` (its address from the store, torch's ``/handler/...``)."""
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}"
    target = sign(token, base, url[len(base) :])
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy in between
    try:
        with direct.open(urllib.request.Request(target, data=b"", method="POST"), timeout=timeout) as reply:
            status, proof, body = reply.status, reply.headers.get(REPLY_HEADER, ""), reply.read()
    except urllib.error.HTTPError as exc:
        status, proof, body = exc.code, exc.headers.get(REPLY_HEADER, ""), exc.read()
    except TimeoutError as exc:
        return 408, f"Timeout: {exc}"
    except (OSError, ValueError, http.client.HTTPException) as exc:  # ValueError: a malformed address
        return 503, f"ConnectionError: {exc}"
    if status == 200 and not hmac.compare_digest(proof, reply_mac(token, target[len(base) :], body)):
        return 502, UNPROVEN
    return status, body.decode(errors="replace")


def guard(frontend: Any, token: str) -> None:
    """Wrap torch's page in ``frontend`` (its module): the token check on every request, signed
    requests to the ranks and proven replies, escaped templates, and a request log without the
    token."""
    _admit_only_the_token(frontend, token)

    def fetch_signed(urls: list[str], timeout: float) -> list[Any]:
        return [frontend.Response(status, text) for status, text in fetch(token, urls, timeout)]

    frontend.fetch_aiohttp = frontend.fetch_thread_pool = fetch_signed  # what torch's ``fetch_all`` calls
    environment = frontend.Environment

    def escaping(*args: Any, **kwargs: Any) -> Any:
        return environment(*args, **{**kwargs, "autoescape": True})

    frontend.Environment = escaping

    def log_message(req: Any, format: str, *args: Any) -> None:
        frontend.logger.info("%s %s", req.client_address[0], redact(format % args, token))

    frontend.HTTPRequestHandler.log_message = log_message


def _admit_only_the_token(frontend: Any, token: str) -> None:
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
