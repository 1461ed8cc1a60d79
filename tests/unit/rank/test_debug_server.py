"""``--debug-server``'s token, without torch: each rank's proxy passes on to the worker server's Unix
socket only requests the page signed with the token for that proxy's own address (the token itself is
never sent to a rank, and the store holds addresses only), the page admits only the token, by query or
cookie, and its request log leaves the token out. The real job is
tests/integration/cli/test_debug_server.py; another user's view of it, tests/integration/security/."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from multigpu.contract.names import DEBUG_SERVER_ENV, debug_server_settings
from multigpu.rank.debug_frontend import COOKIE, UNPROVEN, admitted, fetch, redact
from multigpu.rank.debug_server import SIGNED_FOR_S, serve_with_token, sign

TOKEN = "s3cret-token_1"


class UnixHTTPServer(HTTPServer):
    address_family = socket.AF_UNIX

    def server_bind(self) -> None:
        self.socket.bind(self.server_address)

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        conn, _ = self.socket.accept()
        return conn, ("worker", 0)


class Worker(BaseHTTPRequestHandler):
    """Stands in for torch's worker server: echoes the path it was asked for."""

    def do_POST(self) -> None:
        body = f"worker saw {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[str]:
    target = str(tmp_path / "worker.sock")
    worker = UnixHTTPServer(target, Worker)  # type: ignore[arg-type]
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    front, address = serve_with_token("127.0.0.1", TOKEN, target)
    try:
        assert address == f"http://127.0.0.1:{front.server_address[1]}"  # what goes in the store
        yield address
    finally:
        front.shutdown()
        front.server_close()
        worker.shutdown()
        worker.server_close()


def post(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_the_proxy_passes_on_only_requests_signed_for_it(proxy: str) -> None:
    passed = post(sign(TOKEN, proxy, "/handler/dump_traceback?x=1"))
    assert passed == (200, "worker saw /handler/dump_traceback?x=1")
    assert post(f"{proxy}/handler/dump_traceback")[0] == 403
    assert post(f"{proxy}/{TOKEN}/handler/dump_traceback")[0] == 403  # the token itself opens nothing
    assert post(sign("not-" + TOKEN, proxy, "/handler/dump_traceback"))[0] == 403


def test_a_signature_is_good_for_one_address_one_request_and_a_minute(proxy: str) -> None:
    """What an address planted in the store receives: nothing that opens a real proxy."""
    elsewhere = sign(TOKEN, "http://127.0.0.1:1", "/handler/dump_traceback")
    assert post(proxy + elsewhere.removeprefix("http://127.0.0.1:1"))[0] == 403
    other = sign(TOKEN, proxy, "/handler/dump_traceback")
    assert post(other.replace("dump_traceback", "fr_trace_json"))[0] == 403
    stale = sign(TOKEN, proxy, "/handler/dump_traceback", now=time.time() - SIGNED_FOR_S - 5)
    assert post(stale)[0] == 403
    assert TOKEN not in sign(TOKEN, proxy, "/handler/dump_traceback")
    assert post(f"{proxy}/{'9' * 5000}.ab/handler/x")[0] == 403  # a stamp int() would refuse


class Planted(BaseHTTPRequestHandler):
    """An address another user wrote in the job's store: answers 200 with its own script, and keeps
    what it was asked."""

    asked: list[str] = []

    def do_POST(self) -> None:
        self.asked.append(self.path)
        body = b"<script>steal()</script>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_page_takes_a_reply_only_from_a_proxy_that_holds_the_token(proxy: str) -> None:
    planted = HTTPServer(("127.0.0.1", 0), Planted)
    threading.Thread(target=planted.serve_forever, daemon=True).start()
    elsewhere = f"http://127.0.0.1:{planted.server_address[1]}"
    try:
        answers = fetch(
            TOKEN, [f"{proxy}/handler/dump_traceback?", f"{elsewhere}/handler/dump_traceback?"], 10
        )
    finally:
        planted.shutdown()
        planted.server_close()
    assert answers == [(200, "worker saw /handler/dump_traceback?"), (502, UNPROVEN)]
    assert len(Planted.asked) == 1 and TOKEN not in Planted.asked[0], Planted.asked
    replayed = post(proxy + Planted.asked[0])  # what it was sent opens nothing real
    assert replayed[0] == 403
    assert fetch(TOKEN, ["http://127.0.0.1:1/handler/x?"], 5)[0][0] == 503  # nothing there
    assert fetch("not-" + TOKEN, [f"{proxy}/handler/x?"], 5)[0][0] == 403  # another node's token


def test_the_request_log_leaves_the_token_out() -> None:
    line = f'"GET /stacks?token={TOKEN} HTTP/1.1" 200 -'
    assert redact(line, TOKEN) == '"GET /stacks?token=... HTTP/1.1" 200 -'
    assert (
        redact(f'"GET /fr?rank=1&token={TOKEN}&x=2 HTTP/1.1"', TOKEN)
        == '"GET /fr?rank=1&token=...&x=2 HTTP/1.1"'
    )
    assert redact(f"code 403, message {TOKEN}", TOKEN) == "code 403, message ..."
    assert redact('"GET /?token=wrong HTTP/1.1" 403 -', TOKEN) == '"GET /?token=... HTTP/1.1" 403 -'


def test_the_page_admits_the_token_by_query_or_cookie() -> None:
    assert admitted(TOKEN, TOKEN, "")
    assert admitted(TOKEN, None, f"{COOKIE}={TOKEN}; other=1")
    assert not admitted(TOKEN, None, "")
    assert not admitted(TOKEN, "wrong", f"{COOKIE}={TOKEN}")  # a query given is the one checked
    assert not admitted(TOKEN, None, f"{COOKIE}=wrong")


def test_settings_come_from_the_environment() -> None:
    assert debug_server_settings({}) is None
    env = {DEBUG_SERVER_ENV: json.dumps(["127.0.0.1", 8000, TOKEN])}
    assert debug_server_settings(env) == ("127.0.0.1", 8000, TOKEN)
