"""torch's debug server in a rank (``--debug-server``). Runs in every rank, from the bootstrap, before
the user's code.

torch 2.13's ``torch.distributed.debug.start_debug_server`` binds every rank's worker server and rank
0's page on every interface ("::" and ""), publishes each worker under the machine's host name, and
asks no one who they are: any local user could read another user's stacks (and flight records,
profiles, the store's keys). Here the same parts are put together so that only whoever holds the
run's token gets in. torch's C++ worker server (``_WorkerServer``: this rank's stacks, flight record
and profiles) listens on a Unix socket in a folder only this user can enter; a small proxy on HOST
(loopback unless the user named a host) passes on requests signed with the token; its address alone
goes in the job's store under torch's own keys (``debug_server/rank<N>``, which torch's page reads and
appends ``/handler/...`` to). The store has no authentication, so the token is never in it, and
nothing the store says is trusted with it: the page signs each request for the address it goes to
(``sign``: an HMAC of the time and the whole URL), so an address another user wrote there receives a
signature good for that address only, for a minute. On rank 0 torch's page runs in a helper process
(``rank/debug_frontend.py``) on HOST:PORT, which wants the token itself. The token comes from the
launcher in the rank's environment (readable by this user and root only) and is printed on its
console. A rank whose server cannot start says so in one line and trains on: the debugging aid is not
worth a job.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from multigpu.contract.names import DEBUG_SOCKETS_ENV, debug_server_settings

_KEEP: list[Any] = []
"""The worker server (and rank 0's page process): alive as long as the rank."""
SIGNED_FOR_S = 60
"""How long a signed request stays good, either way of the proxy's clock (nodes' clocks differ a little)."""
REFUSED = (
    "this debug server wants requests signed with the run's token (printed by its launcher; on several "
    "nodes every launcher needs the same MULTIGPU_DEBUG_TOKEN)"
)


def start_if_asked() -> None:
    asked = debug_server_settings(os.environ)
    if asked is None:
        return
    try:
        _start(*asked)
    except Exception as exc:
        print(
            f"multigpu: rank {os.environ.get('RANK', '?')}: the debug server did not start: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )


def url_host(host: str) -> str:
    """The host name other processes reach a server bound to ``host`` by."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _mac(token: str, stamp: str, url: str) -> str:
    return hmac.new(token.encode(), f"{stamp} {url}".encode(), hashlib.sha256).hexdigest()


def sign(token: str, base: str, rest: str, now: float | None = None) -> str:
    """``base + rest`` (``http://HOST:PORT`` and ``/handler/...``) as the proxy at ``base`` accepts it:
    ``base/STAMP.MAC/rest``. The page calls this; the token itself never leaves it."""
    stamp = str(int(time.time() if now is None else now))
    return f"{base}/{stamp}.{_mac(token, stamp, base + rest)}{rest}"


def signed_rest(token: str, base: str, path: str, now: float | None = None) -> str | None:
    """What the proxy at ``base`` passes on for ``path`` (``/STAMP.MAC/rest``): ``/rest`` when the
    signature is the token's, for this very address and rest, and recent; else None."""
    first, slash, rest = path[1:].partition("/")
    stamp, _, mac = first.partition(".")
    if not slash or not stamp.isdigit() or len(stamp) > 12 or not mac:
        return None
    if abs(int(stamp) - (time.time() if now is None else now)) > SIGNED_FOR_S:
        return None
    if not hmac.compare_digest(mac.encode(), _mac(token, stamp, f"{base}/{rest}").encode()):
        return None
    return "/" + rest


REPLY_HEADER = "X-Multigpu-Reply"
"""The proxy's proof that a reply is a token holder's (``reply_mac``): the page shows no 200 without it."""


def reply_mac(token: str, path: str, body: bytes) -> str:
    """What the proxy sends in ``REPLY_HEADER`` for ``body`` in answer to ``path`` (the signed request's
    path, so a reply cannot be replayed for another request)."""
    return hmac.new(token.encode(), b"reply " + path.encode() + b"\n" + body, hashlib.sha256).hexdigest()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class _TokenProxy(BaseHTTPRequestHandler):
    """Passes ``/STAMP.MAC/rest`` (``sign``) on to the worker server as ``/rest``; anything else is 403."""

    token = ""
    target = ""
    base = ""
    """``http://HOST:PORT`` as this proxy publishes itself: what a signature must be for."""

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def _forward(self, method: str) -> None:
        rest = signed_rest(self.token, self.base, self.path)
        if rest is None:
            self.send_error(403, REFUSED)
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        conn = _UnixHTTPConnection(self.target, timeout=60)
        try:
            conn.request(method, rest, body=body)
            reply = conn.getresponse()
            data = reply.read()
        except OSError as exc:
            self.send_error(502, f"the rank's worker server did not answer: {exc}")
            return
        finally:
            conn.close()
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.getheader("Content-Type") or "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.send_header(REPLY_HEADER, reply_mac(self.token, self.path, data))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_with_token(host: str, token: str, target: str) -> tuple[ThreadingHTTPServer, str]:
    """The proxy on ``host`` (a free port) in front of the Unix socket ``target``, served by a daemon
    thread, and its address (``http://HOST:PORT``, what goes in the store)."""
    handler: type[_TokenProxy] = type("TokenProxy", (_TokenProxy,), {"token": token, "target": target})

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    server = Server((host, 0), handler)
    handler.base = f"http://{url_host(host)}:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, name="multigpu-debug-proxy", daemon=True).start()
    return server, handler.base


def _start(host: str, port: int, token: str) -> None:
    from torch._C._distributed_c10d import _WorkerServer
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    # 0700: only this user reaches the socket; inside the launcher's folder, which it removes even
    # when this rank is SIGKILLed (``atexit`` covers a rank run without one)
    parent = os.environ.get(DEBUG_SOCKETS_ENV) or None
    private = tempfile.mkdtemp(
        prefix=f"rank{os.environ['RANK']}-" if parent else "multigpu-debug-", dir=parent
    )
    atexit.register(shutil.rmtree, private, True)
    target = os.path.join(private, "worker.sock")
    server = _WorkerServer(target)
    proxy, address = serve_with_token(host, token, target)
    _KEEP.extend([server, proxy])
    store = PrefixStore(
        "debug_server", TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    )
    rank = int(os.environ["RANK"])
    store.set(f"rank{rank}", address)  # the address alone: every user can read the store
    if rank == 0:
        _KEEP.append(
            subprocess.Popen(
                [sys.executable, "-m", "multigpu.rank.debug_frontend", host, str(port), str(os.getpid())],
                stdin=subprocess.DEVNULL,
            )
        )
