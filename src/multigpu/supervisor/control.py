"""``multigpu stacks`` and ``multigpu status`` from another shell, while the job runs. The socket
side runs in the launcher, on the supervisor's loop; ``ask`` runs in the asking command.

The launcher listens on an abstract Unix socket named after its run and its pid (written to
``run.json`` as ``control_socket``), so nothing is left on disk and no path length limits apply.
Only the run's own user (or root) is answered: the peer's uid comes from the kernel
(``SO_PEERCRED``); anyone else gets ``refused: run RUN belongs to user NAME``, sent after the request
was read (closing with it unread would reset the connection, and the refusal with it). The asking
side checks the launcher's uid the same way before it believes an answer: an abstract name can be
bound by anyone first. A request is one word; the answer is text, and the connection closes. The loop
never waits on a client for more than ``CLIENT_WAIT_S``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable, Sequence

from multigpu.contract.files import user_name
from multigpu.contract.frames import fold_own_threads
from multigpu.supervisor.eta import estimate, progress_text
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.states import Worker

CLIENT_WAIT_S = 0.5
REFUSE_WAIT_S = 0.1
"""How long another user's client may keep the loop waiting for its request (it sends it at once)."""


def socket_name(run_id: str, pid: int | None = None) -> str:
    return f"multigpu-{run_id}-{os.getpid() if pid is None else pid}"


def run_id_of(name: str) -> str:
    """The run id in a ``socket_name``."""
    return name.removeprefix("multigpu-").rsplit("-", 1)[0]


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, from the kernel."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class ControlSocket:
    """The launcher's listening end, for one attempt's supervisor."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind("\0" + name)
            self.sock.listen(4)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, str] | None:
        """A client of the run's own user and its request, or None (nobody there, someone else, or
        a client that sent nothing in time)."""
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return None
        if peer_uid(conn) not in (os.getuid(), 0):
            conn.settimeout(REFUSE_WAIT_S)
            with contextlib.suppress(OSError):
                conn.recv(64)  # read first: a close with the request unread resets the connection
                conn.sendall(
                    f"refused: run {run_id_of(self.name)} belongs to user {user_name(os.getuid())}\n".encode()
                )
            conn.close()
            return None
        conn.settimeout(CLIENT_WAIT_S)
        try:
            request = conn.recv(64).decode(errors="replace").strip()
        except OSError:
            conn.close()
            return None
        return conn, request

    def close(self) -> None:
        self.sock.close()


def answer(
    control: ControlSocket,
    workers: Sequence[Worker],
    dump: Callable[[list[Worker]], object],
    progress: ProgressBook,
    now: float,
) -> None:
    """Answer one client on the supervisor's loop: ``stacks``, every live rank's Python stacks asked
    for now (``dump``); ``status``, one line per rank."""
    asked = control.accept()
    if asked is None:
        return
    conn, request = asked
    with conn:
        if request == "stacks":
            live = [w for w in workers if w.alive]
            dump(live)
            text = (
                "".join(
                    f"rank {w.rank} (pid {w.pid}):\n" + _user_threads(w.dumps.stacks) + "\n\n" for w in live
                )
                or "no rank is running\n"
            )
        else:
            text = "".join(status_line(w, progress, now) + "\n" for w in workers) + job_line(progress)
        with contextlib.suppress(OSError):
            conn.sendall(text.encode())


def _user_threads(dump: Sequence[str]) -> str:
    """A rank's dump as the report shows it: multigpu's own threads (the one that wrote the dump is
    the dump's "current thread") counted in one line; the rank's log has them all."""
    return fold_own_threads("\n".join(dump)) if dump else "(no answer)"


def status_line(worker: Worker, book: ProgressBook, now: float) -> str:
    progress = book.ranks.get(worker.rank)
    step = f"step {progress.step}" if progress is not None and progress.step is not None else "no step"
    quiet = f", last progress {now - progress.last_progress:.1f}s ago" if progress is not None else ""
    return f"rank {worker.rank} pid {worker.pid} {worker.state.value}, {step}{quiet}"


def job_line(book: ProgressBook) -> str:
    """``job: step 120/1000 (12%), ETA 3m20s`` once a rank reported a step; "" before."""
    progress = progress_text(*estimate(list(book.ranks.values()), book.total_steps))
    return f"job: {progress}\n" if progress else ""


def ask(name: str, request: str, owner: int, timeout: float = 30.0) -> str:
    """Send one request to the launcher of a run of user ``owner`` and return its answer, or what it
    sent before the connection failed (OSError where none listens or nothing came back). A socket
    held by anyone but ``owner`` or root is not that launcher: PermissionError, nothing sent."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
        server = peer_uid(sock)
        if server not in (owner, 0):
            raise PermissionError(
                f"the socket {name} is held by user {user_name(server)}, not by the "
                f"run's user {user_name(owner)}: it is not the run's launcher"
            )
        sock.sendall(request.encode() + b"\n")
        chunks: list[bytes] = []
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                if not chunks:
                    raise
                break  # keep what arrived (a refusal is one line, sent before the close)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
