"""torchrun's file-timer watchdog: torch's own ``FileTimerServer``, hosted by the launcher on each node.

With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the launcher's environment, torchrun's agent runs torch's
``FileTimerServer`` and gives every worker ``TORCHELASTIC_TIMER_FILE`` (its FIFO), so a rank's
``timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))`` and
``with timer.expires(after=2): ...`` get it killed when it overstays. ``multigpu run`` hosts the same
server, one per attempt as torchrun does, in a thread of the launcher (torch is imported only then).

Its traps, read in torch 2.13's ``file_based_local_timer.py`` and handled here:

- its constructor deletes and recreates its path, so the path is this node's own (torchrun's
  ``<tmp>/watchdog_timer_<uuid>``, or the user's ``TORCHELASTIC_TIMER_FILE``), never the run folder
  that several nodes may share;
- ``stop()`` waits ``max_interval`` for a thread still blocked opening the FIFO when no client ever
  opened it, and would leave it blocked: ``stop`` opens the FIFO once itself to let it go;
- after it kills a rank it SIGKILLs its own process (torchrun's agent dies with the rank and leaves the
  other ranks running): here that is refused; the supervisor ends every rank's process group, as for
  any failure;
- it signals the pid only, and says which timer only in a log: each kill is noted (pid, process group,
  scope, duration) *before* it is sent (``TimerKills``), so the supervisor names the timer as the
  rank's killer, before it asks about the OOM killer (``exits.failure_of``).

Runs in the launcher: the server's thread, and the supervisor's loop reading ``TimerKills``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from multigpu.contract.frames import library_file

ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
"""``1`` in the launcher's environment: host the watchdog (torchrun reads it from its own)."""
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
"""The FIFO torch's ``FileTimerClient`` writes to: the user's, else one per attempt, in every worker."""
MAX_INTERVAL_S = 0.02
"""The server's loop period. torchrun's 0.1 s would make a timer's duration, read from when its
request arrived, up to 0.2 s short; this keeps it to the tenth of a second the message shows, and the
kill that much closer to the expiry. The loop is a sleep and a read: its cost does not show."""
STOP_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True)
class TimerKill:
    """One rank process the server is about to signal: which timer, and for how long it was set."""

    pid: int
    group: int | None
    """The pid's process group when the timer expired (the rank's pid: every rank leads its own)."""
    scope: str
    seconds: float
    signal: int

    @property
    def where(self) -> str:
        """The scope, a ``file#line`` (``expires()``'s default) without the file's folder."""
        path, sep, line = self.scope.rpartition("#")
        return f"{os.path.basename(path)}#{line}" if sep and line.isdigit() else self.scope

    @property
    def message(self) -> str:
        """The root cause's words after ``rank R (node N, pid P)``. torch 2.13's ``expires()`` names a
        scope given no ``scope=`` after its caller's frame, which is contextlib's: that is said."""
        path, sep, _ = self.scope.rpartition("#")
        unnamed = ": expires() was given no scope=" if sep and library_file(path) else ""
        duration = f"{self.seconds:.1f}".removesuffix(".0")
        return f"overstayed its {duration} s timer (scope {self.where}{unnamed}); killed"

    @property
    def killer(self) -> str:
        """``WorkerFailure.killed_by``: one timer, wherever it expires (the crash-loop signature)."""
        return f"the file timer of scope {self.where}"


class TimerKills:
    """The kills the server sent, by process group and pid: written by its thread, read by the loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kills: dict[int, TimerKill] = {}

    def note(self, kill: TimerKill) -> None:
        with self._lock:
            self._kills[kill.pid] = kill
            if kill.group is not None:
                self._kills.setdefault(kill.group, kill)

    def of(self, pid: int, signal: int) -> TimerKill | None:
        """The kill that ended the rank ``pid`` with ``signal`` (itself, or a process of its group)."""
        with self._lock:
            kill = self._kills.get(pid)
        return kill if kill is not None and kill.signal == signal else None


def wanted(env: Mapping[str, str]) -> bool:
    """torchrun's test: the variable is exactly ``1``."""
    return env.get(ENABLE_ENV) == "1"


def timer_path(env: Mapping[str, str]) -> str:
    """The user's ``TORCHELASTIC_TIMER_FILE``, else torchrun's node-local ``<tmp>/watchdog_timer_<uuid>``."""
    return env.get(TIMER_FILE_ENV) or os.path.join(tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}")


class FileTimerHost:
    """torch's server on ``path`` for one attempt, and the kills it sent (``kills``)."""

    def __init__(self, path: str, run_id: str) -> None:
        self.path = path
        self.kills = TimerKills()
        self._server = _server_class()(path, run_id, self.kills)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()


@contextlib.contextmanager
def hosted(env: Mapping[str, str], run_id: str) -> Iterator[FileTimerHost | None]:
    """The attempt's watchdog when ``env`` asks for it (None otherwise), stopped and its FIFO removed
    when the attempt ends."""
    if not wanted(env):
        yield None
        return
    host = FileTimerHost(timer_path(env), run_id)
    host.start()
    try:
        yield host
    finally:
        host.stop()


def _release_opener(path: str) -> None:
    """Open the FIFO for writing once, without waiting: a server thread blocked opening it (no client
    ever came) then gets past its ``open`` and sees that it is stopped."""
    with contextlib.suppress(OSError):  # ENXIO: nobody is reading (yet, or any more)
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _wait_for_watchdog(thread: threading.Thread | None, path: str) -> None:
    """Up to ``STOP_WAIT_S`` for the server's thread, told to stop, to end: each round releases a
    thread blocked opening the FIFO."""
    deadline = time.monotonic() + STOP_WAIT_S
    while thread is not None and thread.is_alive() and time.monotonic() < deadline:
        _release_opener(path)
        thread.join(MAX_INTERVAL_S)


def _kill_of(request: Any, arrived: float) -> TimerKill:
    """The kill torch's server is about to send for an expired timer that reached it at ``arrived``."""
    pid = request.worker_pid
    try:
        group: int | None = os.getpgid(pid)
    except OSError:
        group = None
    seconds = max(0.0, request.expiration_time - arrived + MAX_INTERVAL_S)  # it arrived that late
    return TimerKill(pid, group, request.scope_id, seconds, request.signal)


def _server_class() -> Any:
    """torch's ``FileTimerServer`` with the traps above handled (built on first use: it imports torch)."""
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

    class HostedFileTimerServer(FileTimerServer):  # type: ignore[misc]
        def __init__(self, path: str, run_id: str, kills: TimerKills) -> None:
            super().__init__(
                file_path=path,
                run_id=run_id,
                max_interval=MAX_INTERVAL_S,
                daemon=True,
                log_event=self._on_event,
            )
            self._kills = kills
            self._arrived: dict[tuple[int, str], float] = {}

        def register_timers(self, timer_requests: list[Any]) -> None:
            now = time.time()
            for request in timer_requests:
                key = (request.worker_pid, request.scope_id)
                if request.expiration_time < 0:  # a release
                    self._arrived.pop(key, None)
                else:
                    self._arrived[key] = now
            super().register_timers(timer_requests)

        def _on_event(self, name: str, request: Any) -> None:
            # torch logs each expired timer in expiry order and signals the first with a signal: the
            # one noted here, before the signal is sent
            if name != "timer expired" or request is None or request.signal <= 0:
                return
            arrived = self._arrived.get((request.worker_pid, request.scope_id), request.expiration_time)
            self._kills.note(_kill_of(request, arrived))

        def _reap_worker(self, worker_pid: int, signal: int) -> bool:
            if worker_pid == os.getpid():
                return True  # torch's server ends its own process after a kill: not the launcher
            return bool(super()._reap_worker(worker_pid, signal))

        def stop(self) -> None:
            self._stop_signaled = True
            _wait_for_watchdog(self._watchdog_thread, self._file_path)
            super().stop()

    return HostedFileTimerServer
