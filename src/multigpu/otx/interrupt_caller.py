"""Function mode: bring a child's failure to rank 0's code within moments, whatever rank 0 is doing.

Two mechanisms, because there are two ways to be stuck:

- **A collective** (gloo or NCCL) or a CUDA synchronize waiting on one runs in C++ and never returns on
  its own while the peers wait too. ``abort_collectives`` makes it return with the backend's error:
  NCCL through torch's own communicator abort; gloo, whose ``abort()`` is a no-op, by shutting down
  the connected TCP sockets its process group opened (``GroupSockets``), which makes every pending
  gloo operation fail with "connection closed", exactly as a peer's death would.
- **Any other wait** (``time.sleep``, a lock, a queue, plain computing) is woken the way Ctrl-C wakes
  it: a signal to the thread that called setup, whose handler raises ``WorkerFailedError``. Python
  runs handlers only in the main thread, so this part needs setup to have run there; in another
  thread, the abort still cuts collectives short and ``finalize()`` raises the error.

A collective can also fail on its own a moment before the failure is known here (a dead peer's
sockets close at once, gloo notices first). ``hook_collective_errors`` catches that case in torch's
own error path for collectives (``c10d_logger._exception_logger``): the thread waits up to
``COLLECTIVE_WAIT_S`` for the supervisor's verdict and raises ``WorkerFailedError`` from the backend
error; a backend error that no child failure explains goes on unchanged, just later.

The handler never raises inside multigpu's own code (``finalize()`` included): it declines, and the
sender tries again moments later, so the error lands in user code or is raised by ``finalize()``.
When the handler runs while a collective's error is being handled, the ``WorkerFailedError`` is
raised ``from`` that error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import sys
import threading
import types
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from multigpu.contract.errors import WorkerFailedError
from multigpu.contract.frames import module_of, own_frame

MACHINERY = frozenset(
    {
        "multigpu.otx.manager",
        "multigpu.otx.prepare",
        "multigpu.otx.interrupt_caller",
        "multigpu.otx.watcher",
        "multigpu.otx.rank_setup",
    }
)
"""Function mode's own modules: a failure is never delivered while one of them is on the stack."""
APPLICATIONS = frozenset({"multigpu.cli.demo", "multigpu.cli.main", "multigpu.__main__"})
"""Code shipped with multigpu that is the user's side here (``multigpu demo`` and the command that runs
it): a failure may be delivered while it runs."""

DELIVERY_SIGNAL = signal.SIGUSR2
"""The signal that interrupts rank 0's waits; its previous handler is restored by ``finalize()``."""
RESEND_S = 0.25
COLLECTIVE_WAIT_S = 2.0
MAX_SENDS = 40  # ~10 s: a thread that stays in C that long is in a collective, which the abort ends


def _socket_inodes() -> dict[int, int]:
    """``{fd: inode}`` of this process's sockets."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                st = os.stat(f"/proc/self/fd/{name}")
                if stat.S_ISSOCK(st.st_mode):
                    found[int(name)] = st.st_ino
    return found


class GroupSockets:
    """The TCP connections a gloo process group opens while it is created, so they can be cut.

    While the group is still being created (rank 0 waits there for a child that may have died), every
    new connection counts, our own store client's included, so the wait ends too.
    """

    def __init__(self) -> None:
        self._inodes: set[int] = set()
        self._before: set[int] | None = None
        self.store_port: int | None = None

    @contextlib.contextmanager
    def recording(self, store_port: int | None) -> Iterator[None]:
        """Note the sockets that appear while the body runs (``init_process_group``)."""
        self.store_port = store_port
        self._before = set(_socket_inodes().values())
        try:
            yield
        finally:
            self._inodes |= set(_socket_inodes().values()) - self._before
            self._before = None

    def cut(self) -> int:
        """Shut down (not close: the descriptors stay gloo's) the group's peer connections."""
        before = self._before
        cut = 0
        for fd, inode in _socket_inodes().items():
            during_init = before is not None and inode not in before
            if (inode in self._inodes or during_init) and self._cut_one(fd, store_client=during_init):
                cut += 1
        return cut

    def _cut_one(self, fd: int, store_client: bool) -> bool:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    return False
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    return False  # gloo's listener: shutting it down kills gloo's event loop
                if sock.getsockname()[1] == self.store_port:
                    return False  # the store we serve: the other nodes still need it
                if sock.getpeername()[1] == self.store_port and not store_client:
                    return False  # our store client: still needed to share the failure and tear down
                sock.shutdown(socket.SHUT_RDWR)
                return True
            except OSError:
                return False


def abort_collectives(sockets: GroupSockets) -> None:
    """Make every collective blocked in this process return with an error. Safe from any thread."""
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
            # ncclCommAbort on every communicator: kernels waiting on a dead peer exit, so a
            # collective's wait or a torch.cuda.synchronize() behind it returns.
            dist.distributed_c10d._abort_process_group()
    sockets.cut()


class FailureDelivery:
    """Raise a ``WorkerFailedError`` in the setup thread, at most once, never inside multigpu's code."""

    def __init__(self, on_deliver: Callable[[], None] | None = None) -> None:
        self.error: WorkerFailedError | None = None
        self.delivered = False
        self._on_deliver = on_deliver
        self._thread_id = threading.get_ident()
        self._can_signal = threading.current_thread() is threading.main_thread()
        self._previous: Any = None
        self._armed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._known = threading.Event()
        self._sender: threading.Thread | None = None

    def arm(self) -> None:
        """Install the handler (main thread only; elsewhere errors come from collectives and finalize)."""
        if self._can_signal and not self._armed:
            self._previous = signal.signal(DELIVERY_SIGNAL, self._handle)
            self._armed = True

    def disarm(self) -> None:
        """Stop sending, then restore the previous handler: no signal can arrive to a default handler."""
        self._stop.set()
        if self._sender is not None and self._sender is not threading.current_thread():
            self._sender.join(5)
        with self._lock:
            if self._armed:
                previous = self._previous if self._previous is not None else signal.SIG_DFL
                signal.signal(DELIVERY_SIGNAL, previous)
                self._armed = False

    def deliver(self, error: WorkerFailedError) -> bool:
        """Record ``error`` and interrupt the setup thread. False when an error was already recorded."""
        with self._lock:
            if self.error is not None:
                return False
            self.error = error
        self._known.set()
        if self._on_deliver is not None:
            self._on_deliver()
        if self._armed and not self._stop.is_set():
            self._sender = threading.Thread(target=self._send, name="multigpu-deliver", daemon=True)
            self._sender.start()
        return True

    def _send(self) -> None:
        for _ in range(MAX_SENDS):
            with self._lock:
                if self.delivered or not self._armed or self._stop.is_set():
                    return
                signal.pthread_kill(self._thread_id, DELIVERY_SIGNAL)
            if self._stop.wait(RESEND_S):
                return

    def raise_pending(self) -> None:
        """Raise the recorded failure here if no signal has delivered it yet (the caller's thread)."""
        with self._lock:
            error = None if self.delivered or self._stop.is_set() else self.error
            if error is not None:
                self.delivered = True
        if error is not None:
            raise error

    def explain(self, backend_error: BaseException) -> None:
        """A collective failed in this process: raise the child's failure from it, if there is one."""
        if self._stop.is_set() or not self._known.wait(COLLECTIVE_WAIT_S):
            return
        error = self.error
        assert error is not None
        if threading.get_ident() == self._thread_id:
            self.delivered = True
        raise error from backend_error

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        error = self.error
        if error is None:  # not ours: someone else's use of the signal
            if callable(self._previous):
                self._previous(signum, frame)
            return
        if self.delivered or self._stop.is_set() or _in_own_code(frame):
            return  # finalize() raises it; or the sender tries again once user code runs
        self.delivered = True
        cause = sys.exc_info()[1]
        if isinstance(cause, RuntimeError) and error.__cause__ is None:
            raise error from cause  # a collective cut short by the abort: keep the backend's error
        raise error


def _in_own_code(frame: FrameType | None) -> bool:
    """Inside function mode's machinery (anywhere on the stack: ``finalize()`` calling into the standard
    library counts), or at the top inside any part of multigpu other than its applications."""
    if frame is not None and own_frame(frame) and module_of(frame) not in APPLICATIONS:
        return True
    while frame is not None:
        if module_of(frame) in MACHINERY:
            return True
        frame = frame.f_back
    return False


def hook_collective_errors(delivery: FailureDelivery) -> Callable[[], None]:
    """Route collective errors through ``delivery.explain``; returns the undo. A no-op without the hook.

    torch's ``_exception_logger`` wraps every c10d collective; in its ``except`` block it calls the
    module global ``_get_msg_dict``. The replacement acts only when called from that block.
    """
    try:
        from torch.distributed import c10d_logger as logger
    except ImportError:
        return lambda: None
    original = getattr(logger, "_get_msg_dict", None)
    wrapper = _inner_code(getattr(logger, "_exception_logger", None))
    if original is None or wrapper is None:
        return lambda: None

    def get_msg_dict(*args: Any, **kwargs: Any) -> Any:
        caught = sys.exc_info()[1]
        if isinstance(caught, RuntimeError) and sys._getframe(1).f_code is wrapper:
            delivery.explain(caught)
        return original(*args, **kwargs)

    logger._get_msg_dict = get_msg_dict
    return lambda: setattr(logger, "_get_msg_dict", original)


def _inner_code(decorator: Any) -> types.CodeType | None:
    codes = [
        c
        for c in getattr(decorator, "__code__", types.SimpleNamespace(co_consts=())).co_consts
        if isinstance(c, types.CodeType) and c.co_name == "wrapper"
    ]
    return codes[0] if len(codes) == 1 else None
