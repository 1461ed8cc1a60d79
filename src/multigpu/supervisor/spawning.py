"""How a rank's process comes to exist: the spawner hook the supervisor calls, and what both kinds share.

The supervisor owns a rank from the moment it exists until it is reaped; *how* it is started is a
spawner's business. ``PopenSpawner`` starts a fresh interpreter (``python -m multigpu.rank``), the
one path for function mode, ``--no-python`` and ``--no-template``. ``template/client.NodeSpawner``
asks the node's warm template to fork the rank instead. Either way the supervisor gets a handle with
``Popen``'s shape (``pid``, ``poll``, ``wait``, ``returncode``, ``stdout``, ``stderr``) for a process
that is the launcher's own child, so its pidfd, reaping and group-signalling logic stays one path.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Protocol

from multigpu.contract.errors import MultiGPUError
from multigpu.contract.names import HEARTBEAT_FD_ENV, SENTINEL_ENV
from multigpu.supervisor.events import Events
from multigpu.supervisor.oom import OomWatch
from multigpu.supervisor.output import WorkerOutput
from multigpu.supervisor.states import ProcessHandle, Worker, WorkerSpec, WorkerState

CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))
"""Where the pids controller's files are: cgroup v1's own hierarchy, or the unified (v2) one."""


class ProcessLimitError(MultiGPUError):
    """A rank could not be started because the kernel refused a new process (``fork``: EAGAIN): the
    user's process limit (``ulimit -u``, ``RLIMIT_NPROC``) or the cgroup's ``pids.max`` was reached.
    One line (the CLI prints it, exit 1), raised in the launcher by ``start_rank``; the supervisor ends
    the ranks it had started before passing it on (``Supervisor.start``)."""

    def __init__(self, rank: int, exc: OSError) -> None:
        why = exc.strerror or str(exc)
        super().__init__(
            f"cannot start rank {rank}: the process limit was reached ({why}; {process_limits()}); "
            "raise the limit (ulimit -u, or the container's or job's pids limit) or start fewer ranks"
        )
        self.rank = rank


def process_limits() -> str:
    """This process's limits on the number of processes, as the one line names them (runs in the
    launcher, when a fork has just failed). Root is held to pids.max, not to ``RLIMIT_NPROC``."""
    limits = []
    if os.geteuid() != 0:
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        limits.append(
            f"ulimit -u (RLIMIT_NPROC) is {'unlimited' if soft == resource.RLIM_INFINITY else soft}"
        )
    pids = cgroup_pids_max()
    if pids is not None:
        limits.append(f"the cgroup's pids.max is {pids}")
    return "; ".join(limits) or "no ulimit -u or pids.max holds it: the system's kernel.threads-max?"


def cgroup_pids_max() -> int | None:
    """The tightest ``pids.max`` of this process's cgroup and its parents; None where none is set or
    none can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers and "pids" not in controllers.split(","):
            continue  # a cgroup v1 hierarchy of another controller
        root = CGROUP_ROOTS[1] if not controllers else CGROUP_ROOTS[0]
        folder = root / path.lstrip("/")
        for level in (folder, *folder.parents):
            with contextlib.suppress(OSError, ValueError):  # "max" is no limit
                found.append(int((level / "pids.max").read_text()))
            if level == root:
                break
    return min(found) if found else None


class Spawner(Protocol):
    def prepare(self, specs: Sequence[WorkerSpec]) -> None:
        """Called by each attempt's supervisor before it starts any rank."""
        ...

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        """Start one rank in its own session, stdin on /dev/null, stdout/stderr on new pipes, and
        exactly ``pass_fds`` inherited besides; ``env`` is its whole environment."""
        ...

    def spared(self) -> frozenset[int]:
        """Processes of the launcher's that a rank's teardown must leave alone (the template)."""
        ...


class PopenSpawner:
    """A fresh interpreter per rank (``spared``: the node's store process, in fallback mode)."""

    def __init__(self, spared: frozenset[int] = frozenset()) -> None:
        self._spared = spared

    def prepare(self, specs: Sequence[WorkerSpec]) -> None:
        pass

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        return subprocess.Popen(
            spec.argv,
            env=env,
            cwd=spec.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=pass_fds,
        )

    def spared(self) -> frozenset[int]:
        return self._spared


def start_rank(spawner: Spawner, spec: WorkerSpec, guarded: bool = False) -> tuple[ProcessHandle, int]:
    """Start ``spec``'s rank with a fresh heartbeat pipe; (its handle, the pipe's read end). ``guarded``:
    the node's sentinel will watch it, so it starts none of its own."""
    if spec.error_file is not None:  # an earlier run's record must never be read as this one's
        with contextlib.suppress(FileNotFoundError):
            spec.error_file.unlink()
    hb_r, hb_w = os.pipe()
    os.set_blocking(hb_r, False)
    os.set_blocking(hb_w, False)
    env = {**spec.env, HEARTBEAT_FD_ENV: str(hb_w)}
    if guarded:
        env[SENTINEL_ENV] = "1"
    try:
        process = spawner.spawn(spec, env, (hb_w,))
    except BlockingIOError as exc:  # fork's EAGAIN: a process limit, not a traceback
        os.close(hb_r)
        raise ProcessLimitError(spec.rank, exc) from None
    except BaseException:
        os.close(hb_r)
        raise
    finally:
        os.close(hb_w)
    return process, hb_r


def bring_up(
    worker: Worker,
    spawner: Spawner,
    output: WorkerOutput,
    events: Events,
    now: float,
    guard: Callable[[int, int], bool] | None = None,
) -> None:
    """Start ``worker``'s rank and watch everything it gives the supervisor: its exit (a pidfd, where
    the kernel has them; else the loop polls), its heartbeat pipe and its output pipes. ``guard`` hands
    the rank to the node's sentinel."""
    output.open(worker)
    worker.popen, hb_r = start_rank(spawner, worker.spec, guarded=guard is not None)
    worker.to(WorkerState.RUNNING)  # its process exists: from here on the teardown must end it
    worker.heartbeat_read_fd = hb_r
    events.watch(hb_r, "beat", worker)
    worker.start_time = time.time()
    worker.lines.last_at = now
    pipes = (("stdout", worker.popen.stdout), ("stderr", worker.popen.stderr))
    for stream in output.attach(worker, pipes):
        events.watch(stream.fd, "out", stream)
    try:
        worker.pidfd = os.pidfd_open(worker.popen.pid)
        events.watch(worker.pidfd, "exit", worker)
    except (AttributeError, OSError):
        worker.pidfd = None  # no pidfds: exits are found by polling each tick
    if guard is not None and worker.pidfd is not None:
        guard(worker.popen.pid, worker.pidfd)
    worker.oom = OomWatch.start(worker.popen.pid)


class AdoptedProcess:
    """A ``Popen``-shaped handle for a child this process did not start itself: a rank the template
    forked (twice) and the kernel re-parented to the launcher, a child subreaper."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None

    def _collect(self, flags: int) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: its status is lost, as Popen reports it
            self.returncode = 0
            return 0
        if pid == 0:
            return None
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._collect(0)
            assert code is not None
            return code
        deadline = time.monotonic() + timeout
        while (code := self._collect(os.WNOHANG)) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.005)
        return code
