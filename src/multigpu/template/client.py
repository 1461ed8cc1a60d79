"""The launcher's end of the node's template (``server.py``): start it, have it fork ranks, end it.

``NodeSpawner`` is the spawner the launcher hands every attempt's supervisor. At the first attempt it
starts the template with the environment all that attempt's ranks share, so torch reads at import
exactly what a fresh rank would have read; later attempts (``--max-restarts``) fork from the same
template. Where a template cannot serve (``--no-python``, ``--no-template``, a template that failed to
start or will not fork) ranks are plain processes, said in one line, and a small store process (the
same program, never asked to fork) still hosts the store: either way each attempt's store lives as
long as the attempt, not as long as rank 0, and the launcher imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from multigpu.config.run import RunConfig
from multigpu.contract.environment import omp_threads, usable_cpu_count
from multigpu.contract.prctl import set_child_subreaper
from multigpu.supervisor.spawning import AdoptedProcess, PopenSpawner
from multigpu.supervisor.states import ProcessHandle, WorkerSpec
from multigpu.template.wire import receive, send

READY_TIMEOUT_S = 600.0
"""A first ``import torch`` from a cold shared file system can take minutes; a dead template is seen
at once (its end of the socket closes), so this only bounds a template that hangs."""
FORKABLE_MODES = ("script", "module")


@dataclass(frozen=True)
class StoreSocket:
    """The job's listening socket (bound by the launcher) and the address the ranks reach it at."""

    fd: int
    host: str
    port: int


class TemplateProcess:
    """One ``python -m multigpu.template`` and the launcher's end of its control socket."""

    def __init__(self, env: dict[str, str], store: StoreSocket | None, preload: Sequence[str],
                 python: str = sys.executable) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [python, "-m", "multigpu.template", "--control-fd", str(theirs.fileno()),
                "--launcher-pid", str(os.getpid()), "--preload", ",".join(preload)]
        fds = [theirs.fileno()]
        if store is not None:
            argv += ["--store-fd", str(store.fd), "--store-host", store.host, "--store-port", str(store.port)]
            fds.append(store.fd)
        try:
            self.process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, start_new_session=True, pass_fds=fds)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.control = ours
        self.store_pid: int | None = None

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
        answer, extra = receive(self.control)
        for fd in extra:
            os.close(fd)
        if answer is None or "pid" not in answer:
            raise OSError((answer or {}).get("error", "the template is gone"))
        return int(answer["pid"])

    def renew_store(self) -> None:
        """A fresh store for the next attempt, on the same socket (the last one's keys are gone)."""
        send(self.control, {"op": "store"})
        answer, extra = receive(self.control)
        for fd in extra:
            os.close(fd)
        if answer is None or "error" in answer:
            raise OSError((answer or {}).get("error", "the template is gone"))
        self.store_pid = answer.get("store_pid")

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


def shared_env(specs: Sequence[WorkerSpec]) -> dict[str, str]:
    """The variables every rank gets with the same value: what the template is started with."""
    first = dict(specs[0].env) if specs else dict(os.environ)
    return {k: v for k, v in first.items() if all(s.env.get(k) == v for s in specs)}


def forkable(spec: WorkerSpec) -> bool:
    """A rank of ``python -m multigpu.rank script|module`` (not ``--no-python``, not function mode)."""
    argv = spec.argv
    return len(argv) >= 4 and argv[0] == sys.executable and argv[1:3] == ["-m", "multigpu.rank"] \
        and argv[3] in FORKABLE_MODES


class NodeSpawner:
    """Forks ranks from the node's template, or starts plain processes where it cannot (see module).

    ``start`` launches the template (or the store process) at once and does not wait: it imports
    torch while the launcher meets its peers, so a launcher never stalls its own beats on it.
    """

    def __init__(self, *, use_template: bool, store: StoreSocket | None, preload: Sequence[str] = (),
                 notify: Callable[[str], None], why_not: str = "--no-template",
                 python: str = sys.executable) -> None:
        self._python = python
        self._use_template = use_template
        self._why_not = why_not
        self._store = store
        self._preload = tuple(preload)
        self._notify = notify
        self._template: TemplateProcess | None = None
        self._store_process: TemplateProcess | None = None
        self._plain = PopenSpawner()
        self._started: float | None = None
        self._env: dict[str, str] = {}
        self._prepared = False
        self._forks = True

    @property
    def template(self) -> TemplateProcess | None:
        return self._template

    def start(self, env: dict[str, str]) -> None:
        """Start the template (or, without one, the store process) with ``env``; no waiting."""
        self._started, self._env = time.monotonic(), env
        if self._use_template:
            self._template = TemplateProcess(env, self._store, self._preload, self._python)
        elif self._store is not None:
            self._store_process = TemplateProcess(env, self._store, (), self._python)

    def prepare(self, specs: Sequence[WorkerSpec]) -> None:
        """Before each attempt's ranks: the first time, wait for what ``start`` started (starting it
        now if nobody did); later, a fresh store for the attempt."""
        if self._prepared:
            self._renew_store(specs)
            return
        if self._started is None:
            self.start(shared_env(specs))
        self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until what ``start`` started is ready, falling back (said once) if the template is not.

        Several nodes call it before they meet, so a node whose template is still importing torch is
        not taken for a lost node by its peers while its first attempt starts."""
        if self._prepared:
            return
        self._prepared = True
        if self._template is not None:
            why = self._template.wait_ready()
            if why is None:
                return
            self._template.close()
            self._template = None
            took = time.monotonic() - (self._started or 0.0)
            self._why_not = f"the worker template failed to start after {took:.1f}s: {why}"
            if self._store is not None:
                self._store_process = TemplateProcess(self._env, self._store, (), self._python)
        self._notify(f"ranks start as plain processes ({self._why_not})")
        if self._store_process is not None:
            why = self._store_process.wait_ready()
            if why is not None:
                raise OSError(f"the job's store process failed to start: {why}")

    def _renew_store(self, specs: Sequence[WorkerSpec]) -> None:
        """A fresh store for a restart; a template that died meanwhile is replaced by plain ranks
        and a new store process."""
        host = self._template or self._store_process
        if self._store is None or host is None:
            return
        try:
            host.renew_store()
        except OSError as exc:
            host.close()
            self._template = None
            self._notify(f"the worker template is gone ({exc}); ranks start as plain processes from here on")
            self._store_process = TemplateProcess(shared_env(specs), self._store, (), self._python)
            why = self._store_process.wait_ready()
            if why is not None:
                raise OSError(f"the job's store process failed to start: {why}") from None

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        if self._template is None or not self._forks or not forkable(spec):
            return self._plain.spawn(spec, env, pass_fds)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = self._template.fork(spec.argv, env, spec.cwd or os.getcwd(), [out_w, err_w, *pass_fds],
                                      [1, 2, *pass_fds])
        except OSError as exc:
            os.close(out_r)
            os.close(err_r)
            self._forks = False  # it still hosts the store
            self._notify(f"the worker template could not fork rank {spec.rank} ({exc}); plain "
                         f"processes from here on")
            return self._plain.spawn(spec, env, pass_fds)
        finally:
            os.close(out_w)
            os.close(err_w)
        return AdoptedProcess(pid, open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0))

    def spared(self) -> frozenset[int]:
        hosts = (self._template, self._store_process)
        return frozenset().union(*(h.pids() for h in hosts if h is not None))

    def close(self) -> None:
        for host in (self._template, self._store_process):
            if host is not None:
                host.close()
        self._template = self._store_process = None


def spawner_for(config: RunConfig, store: StoreSocket | None, notify: Callable[[str], None],
                base_env: Mapping[str, str]) -> NodeSpawner:
    """The node's spawner for a ``multigpu run`` (script, module or ``--no-python``) job, started.

    The template gets what every rank's environment shares that torch may read at import: the
    launcher's environment, ``--env`` settings, and the ranks' default ``OMP_NUM_THREADS``. A rank
    whose value differs still gets it (``child.reseed`` applies it as torch would have).
    """
    use = config.supervision.template and config.start.run_mode == "python" and not config.function
    why = "--no-python" if config.start.run_mode == "exec" else "--no-template"
    if use and not set_child_subreaper():  # forked ranks must be re-parented to the launcher
        use, why = False, "cannot adopt forked ranks: no child subreaper"
    spawner = NodeSpawner(use_template=use, store=store, preload=config.supervision.preload, notify=notify,
                          why_not=why)
    env = {**base_env, **config.extra_env}
    env.setdefault("OMP_NUM_THREADS", str(omp_threads(usable_cpu_count(), config.nproc)))
    spawner.start(env)
    return spawner
