"""``--debug-server``'s token, without torch: each rank's proxy passes on only ``/TOKEN/...`` to the
worker server's Unix socket, and the page admits only the token, by query or cookie. The real job is
tests/integration/cli/test_debug_server.py."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from multigpu.contract.names import DEBUG_SERVER_ENV, debug_server_settings
from multigpu.rank.debug_frontend import COOKIE, admitted
from multigpu.rank.debug_server import serve_with_token

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
    front = serve_with_token("127.0.0.1", TOKEN, target)
    try:
        yield f"http://127.0.0.1:{front.server_address[1]}"
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


def test_the_proxy_passes_on_only_requests_with_the_token(proxy: str) -> None:
    passed = post(f"{proxy}/{TOKEN}/handler/dump_traceback?x=1")
    assert passed == (200, "worker saw /handler/dump_traceback?x=1")
    assert post(f"{proxy}/handler/dump_traceback")[0] == 403
    assert post(f"{proxy}/{TOKEN[:-1]}/handler/dump_traceback")[0] == 403
    assert post(f"{proxy}/{TOKEN}x/handler/dump_traceback")[0] == 403


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
