"""The control socket's answers to the wrong user, both ways: another user's client gets one refusal
line (read after its request, so the close does not reset it away), and a client believes no launcher
but the run's user's (or root's). Another uid is simulated on one end of a real socket pair; the real
second user is tests/integration/security/test_second_user.py."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from multigpu.contract import files
from multigpu.supervisor import control
from multigpu.supervisor.control import ControlSocket, ask, socket_name

OTHER = 4242 + os.getuid()


@pytest.fixture
def server() -> Iterator[ControlSocket]:
    sock = ControlSocket(socket_name("20261206-000000-abcdef", 4_000_000 + os.getpid()))
    try:
        yield sock
    finally:
        sock.close()


def pretend(monkeypatch: pytest.MonkeyPatch, side: str) -> None:
    """The peer seen from ``side`` ("server": the client; "client": the launcher) is user OTHER."""
    real = control.peer_uid

    def peer_uid(sock: socket.socket) -> int:
        accepted = bool(sock.getsockname())  # the launcher's end has the name; the client's has none
        return OTHER if accepted == (side == "server") else real(sock)

    monkeypatch.setattr(control, "peer_uid", peer_uid)


def asked(server: ControlSocket, owner: int) -> tuple[list[object], threading.Thread]:
    got: list[object] = []

    def client() -> None:
        try:
            got.append(ask(server.name, "status", owner=owner, timeout=10))
        except OSError as exc:
            got.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    return got, thread


def test_another_users_client_gets_the_refusal_line(
    server: ControlSocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend(monkeypatch, "server")
    got, thread = asked(server, owner=os.getuid())
    server.sock.setblocking(True)
    server.sock.settimeout(10)
    assert server.accept() is None  # refused: nothing for the loop to answer
    thread.join(10)
    user = files.user_name(os.getuid())
    assert got == [f"refused: run 20261206-000000-abcdef belongs to user {user}\n"]


def test_the_runs_user_is_answered(server: ControlSocket) -> None:
    got, thread = asked(server, owner=os.getuid())
    server.sock.setblocking(True)
    server.sock.settimeout(10)
    accepted = server.accept()
    assert accepted is not None and accepted[1] == "status"
    with accepted[0] as conn:
        conn.sendall(b"rank 0 pid 1 running\n")
    thread.join(10)
    assert got == ["rank 0 pid 1 running\n"]


def test_a_socket_held_by_another_user_is_not_believed(
    server: ControlSocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend(monkeypatch, "client")
    with pytest.raises(PermissionError, match=f"is held by user .*{OTHER}.*, not by the run's user"):
        ask(server.name, "status", owner=os.getuid(), timeout=10)


def test_the_name_carries_the_run_id() -> None:
    assert control.run_id_of(socket_name("20261206-000000-abc-def", 77)) == "20261206-000000-abc-def"
