"""The template process as the launcher holds it: started, configured, asked for ranks, ended.

Runs in the launcher. Kept light (standard library and the channel only) because the ``multigpu``
command starts the template here before it imports anything else (``start_early``): the template's
``import torch`` (about a second) then overlaps the launcher's own start (imports, parsing, binding the
store socket, meeting its peers) instead of following it. What the launcher only knows once it has
parsed its command line (the store's socket, ``--preload``) reaches the template in its first message
(``configure``), which it reads after its ``import torch``. ``client.NodeSpawner`` adopts the early
template when it was started with the environment the ranks share (``OMP_NUM_THREADS`` aside); otherwise
it is ended and a template is started as before. ``multigpu.launch``'s launcher, which serves one
launch after another, keeps the template of a launch that went well in the same slot (``retain``), so
the next launch adopts it by the same rule. Whatever the ranks get, the template itself runs with
every thread pool held to one thread (``pools.held``): a process with threads must not fork, and each
rank sizes its pools from its own environment once forked (``pools.Pools.apply``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from multigpu.contract.limits import lift_open_file_limit
from multigpu.contract.warm import Warm
from multigpu.template.pools import held
from multigpu.template.wire import receive, send

READY_TIMEOUT_S = 600.0
"""A first ``import torch`` from a cold shared file system can take minutes; a dead template is seen
at once (its end of the socket closes), so this only bounds a template that hangs."""
RELEASE_TIMEOUT_S = 10.0
"""A launch's store ends within 2 s of being told (then SIGKILL): a template that has not said so by
then is not kept."""
OMP = "OMP_NUM_THREADS"
NOT_A_JOB = ("-h", "--help")


@dataclass(frozen=True)
class StoreSocket:
    """The job's listening socket (bound by the launcher) and the address the ranks reach it at."""

    fd: int
    host: str
    port: int


class TemplateProcess:
    """One ``python -m multigpu.template`` and the launcher's end of its control socket."""

    def __init__(self, env: Mapping[str, str], python: str = sys.executable) -> None:
        lift_open_file_limit()  # the template and its ranks inherit the launcher's raised limit
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [
            python,
            "-m",
            "multigpu.template",
            "--control-fd",
            str(theirs.fileno()),
            "--launcher-pid",
            str(os.getpid()),
        ]
        try:
            self.process = subprocess.Popen(
                argv,
                env=held(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=[theirs.fileno()],
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.env = dict(env)
        self.python = python
        self.control = ours
        self.store_pid: int | None = None
        self.preload: tuple[str, ...] | None = None
        """What it imported besides torch, once configured (a kept template serves only the same)."""

    def configure(self, store: StoreSocket | None, preload: Sequence[str]) -> None:
        """Its first message: the store's socket to serve (if this node hosts the store) and the
        modules to import besides torch. The template reads it once its ``import torch`` is done; a
        template kept from an earlier launch (``retain``) reads it at once. ``wait_ready`` reads the
        answer either way."""
        self.preload = tuple(preload)
        message = {
            "op": "configure",
            "preload": list(preload),
            "store_host": store.host if store else None,
            "store_port": store.port if store else None,
        }
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died: wait_ready says how
            send(self.control, message, [store.fd] if store is not None else [])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> str | None:
        """None once the template is ready; otherwise why it is not."""
        ready, _, _ = select.select([self.control], [], [], timeout)
        if not ready:
            return f"not ready after {timeout:g}s"
        try:
            message, fds = receive(self.control)
        except (OSError, ValueError) as exc:
            return f"no answer ({exc})"
        for fd in fds:
            os.close(fd)
        if message is None:
            return f"it exited with code {self.process.wait()}"
        if not message.get("ready"):
            return str(message.get("error", "it said no"))
        self.store_pid = message.get("store_pid")
        return None

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int], targets: list[int]) -> int:
        """Have the template fork a rank with ``fds`` at the numbers ``targets``; the rank's pid."""
        send(self.control, {"argv": argv, "env": env, "cwd": cwd, "fds": targets}, fds)
        return int(str(self._answer("pid")["pid"]))

    def renew_store(self) -> None:
        """A fresh store for the next attempt, on the same socket (the last one's keys are gone)."""
        send(self.control, {"op": "store"})
        pid = self._answer("store_pid")["store_pid"]
        self.store_pid = None if pid is None else int(str(pid))

    def _answer(self, key: str) -> dict[str, object]:
        answer, extra = receive(self.control)
        for fd in extra:
            os.close(fd)
        if answer is None or key not in answer:
            if (answer or {}).get("errno") == errno.EAGAIN:  # the fork hit a process limit
                raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
            raise OSError((answer or {}).get("error", "the template is gone"))
        return answer

    def release(self) -> bool:
        """Its launch is over: its store ends and the launch's socket is closed. False if it could
        not say so (it is gone or broken: not to be kept)."""
        try:
            send(self.control, {"op": "release"})
            ready, _, _ = select.select([self.control], [], [], RELEASE_TIMEOUT_S)
            if not ready:  # stuck: ended by the caller, never waited for without bound
                return False
            self._answer("released")
        except (OSError, ValueError):
            return False
        self.store_pid = None
        return True

    def pids(self) -> frozenset[int]:
        return frozenset(p for p in (self.process.pid, self.store_pid) if p is not None)

    def close(self) -> None:
        """End it and its store at once (SIGKILL to its group), and reap both.

        Called once the ranks are gone and the record is written: the template and its store hold
        nothing a user needs then, and a graceful exit would cost the interpreter teardown of a
        process with torch loaded (0.3-0.7 s) on every run's way out, failures included."""
        self.control.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the template, its store, any middle process
        self.process.wait()
        if self.store_pid is not None:  # re-parented to this launcher (a subreaper) when the template died
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.store_pid, 0)


_early: Warm[TemplateProcess] = Warm(TemplateProcess.close)
"""The template started early (``start_early``) or kept from the launch before (``retain``), until a
launch adopts it (``take_early``) or nobody will (``close_early``)."""
_keep = threading.Event()
"""Whether a template outlives its launch (``keep_warm``): only in a launcher that serves one launch
after another; ``multigpu run``'s launcher exits after its one run."""


def start_early(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> None:
    """``multigpu run ...``: start the template now, with the launcher's environment, which the ranks
    will most likely share (its thread pools are held to one thread whatever the ranks get, so the
    worker count need not be known yet). Anything else (another command, ``--help``) starts nothing."""
    if not argv or argv[0] != "run" or any(a in NOT_A_JOB for a in argv[1:]):
        return
    with contextlib.suppress(OSError):
        _early.get_or_start(lambda: TemplateProcess(dict(environ)))


def keep_warm() -> None:
    """From now on a template whose launch went well is kept for the next launch (``retain``)."""
    _keep.set()


def retain(template: TemplateProcess) -> bool:
    """Keep ``template`` for the next launch (``take_early`` adopts it when the environment and the
    preloads are the same; else it is ended then) if this launcher keeps templates; its launch's
    store is ended first. False: the caller ends it."""
    if not _keep.is_set() or _early.held() is not None or template.process.poll() is not None:
        return False
    if not template.release():
        return False
    return _early.put(template)


def take_early(env: Mapping[str, str], python: str, preload: Sequence[str] = ()) -> TemplateProcess | None:
    """The early (or kept) template, if it was started as this node's template would be and imported
    the same modules; else None (and it is ended). Either way it is taken only once."""
    early = _early.take()
    if early is None:
        return None
    same_preload = early.preload is None or early.preload == tuple(preload)
    if early.python == python and same_preload and _without_omp(early.env) == _without_omp(env):
        return early
    early.close()
    return None


def close_early() -> None:
    """End an early template nobody adopted (a usage error, a command that needs none)."""
    _early.close()


def _without_omp(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != OMP}
