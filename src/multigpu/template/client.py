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

import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

from multigpu.config.run import RunConfig
from multigpu.contract.prctl import set_child_subreaper
from multigpu.supervisor.spawning import AdoptedProcess, PopenSpawner
from multigpu.supervisor.states import ProcessHandle, WorkerSpec
from multigpu.template.process import StoreSocket, TemplateProcess, retain, take_early

logger = logging.getLogger(__name__)

FORKABLE_MODES = ("script", "module", "function")
PREFLIGHT_MODULE = "multigpu.preflight"
"""The preflight check's program (``preflight/``), which the template forks as it forks a rank."""


def shared_env(specs: Sequence[WorkerSpec]) -> dict[str, str]:
    """The variables every rank gets with the same value: what the template is started with."""
    first = dict(specs[0].env) if specs else dict(os.environ)
    return {k: v for k, v in first.items() if all(s.env.get(k) == v for s in specs)}


def forkable(spec: WorkerSpec) -> bool:
    """A rank of ``python -m multigpu.rank script|module|function`` (not ``--no-python``), or the
    node's preflight check (``python -m multigpu.preflight TASK``)."""
    argv = spec.argv
    if len(argv) < 4 or argv[0] != sys.executable:
        return False
    return argv[1:3] == ["-m", PREFLIGHT_MODULE] or (
        argv[1:3] == ["-m", "multigpu.rank"] and argv[3] in FORKABLE_MODES
    )


class NodeSpawner:
    """Forks ranks from the node's template, or starts plain processes where it cannot (see module).

    ``start`` launches the template (or the store process) at once and does not wait: it imports
    torch while the launcher meets its peers, so a launcher never stalls its own beats on it.
    """

    def __init__(
        self,
        *,
        use_template: bool,
        store: StoreSocket | None,
        preload: Sequence[str] = (),
        why_not: str = "--no-template",
        python: str = sys.executable,
    ) -> None:
        self._python = python
        self._use_template = use_template
        self._why_not = why_not
        self._store = store
        self._preload = tuple(preload)
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
            self._template = self._host(env, self._preload)
        elif self._store is not None:
            self._store_process = self._host(env, ())

    def _host(self, env: dict[str, str], preload: Sequence[str]) -> TemplateProcess:
        """The template the ``multigpu`` command started first thing, if it has this environment;
        else a new one. Configured with this node's store socket and ``preload``."""
        host = take_early(env, self._python, preload) or TemplateProcess(env, self._python)
        host.configure(self._store, preload)
        return host

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
                self._store_process = self._host(self._env, ())
        logger.info(f"ranks start as plain processes ({self._why_not})")
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
            logger.warning(
                f"the worker template is gone ({exc}); ranks start as plain processes from here on"
            )
            self._store_process = self._host(shared_env(specs), ())
            why = self._store_process.wait_ready()
            if why is not None:
                raise OSError(f"the job's store process failed to start: {why}") from None

    def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
        if self._template is None or not self._forks or not forkable(spec):
            return self._plain.spawn(spec, env, pass_fds)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = self._template.fork(
                spec.argv, env, spec.cwd or os.getcwd(), [out_w, err_w, *pass_fds], [1, 2, *pass_fds]
            )
        except OSError as exc:
            os.close(out_r)
            os.close(err_r)
            if isinstance(exc, BlockingIOError):
                raise  # a process limit: a plain process could not start either (``start_rank``)
            self._forks = False  # it still hosts the store
            logger.warning(
                f"the worker template could not fork rank {spec.rank} ({exc}); plain processes from here on"
            )
            return self._plain.spawn(spec, env, pass_fds)
        finally:
            os.close(out_w)
            os.close(err_w)
        return AdoptedProcess(pid, open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0))

    def spared(self) -> frozenset[int]:
        hosts = (self._template, self._store_process)
        return frozenset().union(*(h.pids() for h in hosts if h is not None))

    def close(self) -> None:
        """End the template and the store process; a template that forked every rank it was asked
        for is kept for the next launch instead, where the launcher keeps them (``process.retain``)."""
        template, store_process = self._template, self._store_process
        self._template = self._store_process = None
        if template is not None and not (self._forks and retain(template)):
            template.close()
        if store_process is not None:
            store_process.close()


def spawner_for(config: RunConfig, store: StoreSocket | None, base_env: Mapping[str, str]) -> NodeSpawner:
    """The node's spawner for a ``multigpu run`` (script, module or ``--no-python``) job or a
    ``multigpu.launch`` (function mode), started.

    The template gets what every rank's environment shares that torch may read at import: the
    launcher's environment and ``--env`` settings. Its own thread pools are held at one
    (``pools.held``); each forked rank sizes them from its own ``OMP_NUM_THREADS``
    (``pools.Pools.apply``), as torch would have at start.
    """
    use = config.supervision.template and config.start.run_mode == "python"
    why = "--no-python" if config.start.run_mode == "exec" else "--no-template"
    if use and not set_child_subreaper():  # forked ranks must be re-parented to the launcher
        use, why = False, "cannot adopt forked ranks: no child subreaper"
    spawner = NodeSpawner(use_template=use, store=store, preload=config.supervision.preload, why_not=why)
    spawner.start({**base_env, **config.extra_env})
    return spawner
