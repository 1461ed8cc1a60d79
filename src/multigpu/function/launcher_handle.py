"""The caller's end of its launcher process (``function/launcher.py``): started once, kept warm, ended.

Runs in the caller. The first ``multigpu.launch`` starts the launcher; later launches reuse it, and with
it a template that already imported torch, so a second launch starts in a fraction of the first's time.
A launch made while another runs (from another thread) gets a launcher of its own, ended after it.

While a launch runs, the waiting thread itself copies the launcher's output into ``sys.stdout`` and
``sys.stderr``, so a notebook shows each rank's lines in the running cell. A Ctrl-C (a kernel
interrupt) there is passed to the launcher, which stops every rank and dies of it; the caller then
raises ``KeyboardInterrupt`` and the next launch starts a new launcher. ``shutdown`` ends the launcher
(also at the caller's exit); if the caller dies instead, the launcher's guard ends it and its ranks.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from multigpu.contract.warm import Warm

STOP_WAIT_S = 30.0
"""After a Ctrl-C: how long the launcher gets to stop every rank before it is killed (its ranks go too)."""
POLL_S = 0.5
LAUNCHER = (sys.executable, "-m", "multigpu.function.launcher")
"""Its command line, then: the caller's pid, the reply pipe, the caller's temporary folder (where its
launches' private folders are, for the launcher's keeper to sweep should the caller die)."""


class LauncherProcess:
    """One ``python -m multigpu.function.launcher``, its output pipes and its reply pipe."""

    def __init__(self) -> None:
        reply_read, reply_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [*LAUNCHER, str(os.getpid()), str(reply_write), tempfile.gettempdir()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=[reply_write],
                start_new_session=True,
                env=dict(os.environ),
                cwd=os.getcwd(),
            )
        except BaseException:
            os.close(reply_read)
            raise
        finally:
            os.close(reply_write)
        self.reply = reply_read
        assert self.process.stdout is not None and self.process.stderr is not None
        self.streams = {
            pipe.fileno(): (name, codecs.getincrementaldecoder("utf-8")("replace"))
            for pipe, name in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr"))
        }
        for fd in self.streams:
            os.set_blocking(fd, False)
        self.open = set(self.streams)
        """The output pipes not yet at their end."""
        self.busy = threading.Lock()

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, request: Path) -> int:
        """Have it run the launch in ``request``; its exit code (negative: it died of that signal)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(f"{request}\n".encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died: its exit status says how
        try:
            return self._wait_reply()
        except KeyboardInterrupt:
            self._interrupt()
            raise

    def _wait_reply(self, deadline: float | None = None) -> int:
        """A selector, not ``select.select``: a long-lived kernel may hold descriptors past 1024."""
        with selectors.DefaultSelector() as selector:
            for fd in (self.reply, *self.open):
                selector.register(fd, selectors.EVENT_READ)
            return self._wait_ready(selector, deadline)

    def _wait_ready(self, selector: selectors.BaseSelector, deadline: float | None) -> int:
        reply = b""
        while True:
            ready = {key.fd for key, _ in selector.select(POLL_S)}
            self._copy(fd for fd in ready if fd in self.streams)
            for fd in ready - self.open - {self.reply}:
                selector.unregister(fd)  # at its end: it would be ready at every call
            if self.reply in ready:
                reply += os.read(self.reply, 64)
                if reply.endswith(b"\n"):
                    self._copy(self.open)  # what it wrote before the reply
                    return int(reply)
            if self.process.poll() is not None:
                self._copy(self.open)
                return int(self.process.returncode or 1)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError

    def _copy(self, fds: Iterable[int]) -> None:
        for fd in list(fds):
            name, decoder = self.streams[fd]
            with contextlib.suppress(BlockingIOError, OSError):
                while data := os.read(fd, 65536):
                    with contextlib.suppress(Exception):
                        stream = getattr(sys, name)
                        stream.write(decoder.decode(data))
                        stream.flush()
                self.open.discard(fd)  # end of file: every writer is gone

    def _interrupt(self) -> None:
        """Pass the Ctrl-C on; its output keeps coming here until it has stopped every rank and died."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGINT)
        with contextlib.suppress(TimeoutError, KeyboardInterrupt):
            self._wait_reply(deadline=time.monotonic() + STOP_WAIT_S)
        self.close(kill=True)

    def retire(self) -> None:
        """End it from any thread: closed now if no launch holds it; else killed (its guard takes the
        ranks along), and the thread that holds it closes it once its launch has returned
        (``launcher``), so no descriptor is closed under a thread that waits on it."""
        if self.busy.acquire(blocking=False):
            try:
                self.close()
            finally:
                self.busy.release()
        elif self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    def close(self, kill: bool = False) -> None:
        """End it: stdin closed (it leaves when idle), or SIGKILL (its guard takes its ranks along).
        Safe twice: the descriptors are closed once. Only its holder calls it (``busy``)."""
        if self.reply < 0:
            return
        if kill and self.alive():
            self.process.kill()
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._copy(self.streams)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()
        with contextlib.suppress(OSError):
            os.close(self.reply)
        self.reply = -1


_shared: Warm[LauncherProcess] = Warm(LauncherProcess.retire)
"""The warm launcher: replaced (the old one retired) when it has died."""


def _start() -> LauncherProcess:
    started = LauncherProcess()
    atexit.unregister(shutdown)  # registered once, whatever the number of launchers
    atexit.register(shutdown)
    return started


@contextlib.contextmanager
def launcher() -> Iterator[LauncherProcess]:
    """The warm launcher, started if needed, held for one launch (or a launcher of its own if busy)."""
    shared = _shared.get_or_start(_start, LauncherProcess.alive)
    if shared.busy.acquire(blocking=False):
        try:
            yield shared
        finally:
            if _shared.held() is not shared:  # shut down or replaced while it ran: ours to close
                shared.close()
            shared.busy.release()
        return
    own = LauncherProcess()
    try:
        yield own
    finally:
        own.close()


def shutdown() -> None:
    """End the warm launcher and its template (``multigpu.shutdown()``); the next launch starts anew."""
    _shared.close()
