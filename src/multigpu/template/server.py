"""The warm worker template: ``python -m multigpu.template``, one per node, forks every rank.

A fresh rank pays a Python start and an ``import torch`` (1.3-2.2 s of CPU here; on a GPU node eight
ranks importing at once from a shared file system is a start-up storm), and every restart pays it
again. The template pays it once: the launcher starts it before the first attempt with the
environment its ranks share, it imports torch (and ``--preload`` modules) before any CUDA or
process-group state exists, and then forks each rank on request, for every attempt of the run.

The launcher may start it before it has parsed its own command line (``process.start_early``), so
what depends on that command line comes in its first message, read after the ``import torch``:
the store's listening socket and the ``--preload`` modules (``configure``).

It also hosts the job's c10d store, so the store lives as long as the attempt, not as long as rank 0.
The store's server runs threads, and a process with threads must not fork, so the store lives in a
child forked right after the imports, and again for each attempt (``{"op": "store"}``): torch's ranks
put no per-attempt prefix on their keys (with an agent store it expects a new store per attempt), so
every attempt gets a fresh store on the same listening socket. Without a template (``--no-template``,
``--no-python``) the same program, never asked to fork a rank, is the node's store process.

The protocol, on a ``SOCK_SEQPACKET`` socket pair whose other end the launcher holds (the pattern of
Python's multiprocessing forkserver): the template says ``{"ready": ...}`` once; each request is a
JSON ``{"argv", "env", "cwd", "fds"}`` carrying descriptors (SCM_RIGHTS) that the rank gets at the
numbers ``fds`` names; the answer is ``{"pid": N}`` or ``{"error": TEXT}``. The rank is forked twice
(template -> middle -> rank) and the middle exits at once, so the rank is re-parented to the launcher,
a child subreaper, which waits for it, signals its group and reads its exit status as for any child.
The rank itself is made indistinguishable from a fresh one in ``child.py``; the channel is ``wire.py``.
A launcher that serves launch after launch (``multigpu.launch``'s) keeps its template between them:
``{"op": "release"}`` ends a launch's store and closes its socket, and the next launch's
``{"op": "configure"}`` (the first message's fields) gives it the new one, answered like the first
``{"ready": ...}``. The template ends when the control socket closes, and with the launcher
(parent-death signal), taking the store with it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from multigpu.contract.prctl import set_pdeathsig
from multigpu.template.child import become_rank
from multigpu.template.pools import Pools
from multigpu.template.wire import receive, send


def warm_up() -> None:
    """The imports every rank does: torch. Done before the launcher's first message is read, so the
    import overlaps the launcher's own start (it may have started this process before parsing its
    command line). torch's NumPy warning is already hidden (``multigpu/__init__.py``)."""
    import torch
    import torch.distributed  # noqa: F401


def configure(control: socket.socket) -> tuple[Store, Pools] | None:
    """Read the launcher's first message and act on it (``setup``). None if the launcher closed the
    channel instead."""
    message, fds = receive(control)
    if message is None:
        return None
    store = Store(None, "127.0.0.1", 0)
    return store, setup(message, fds, store)


def setup(message: dict[str, Any], fds: list[int], store: Store) -> Pools:
    """A launch's configuration: import what ``--preload`` names, find the BLAS pools the ranks will
    size (``pools.py``), freeze the heap, and serve the store on the launch's socket if this node hosts
    it. The first message, and again for each later launch of a launcher that keeps its template warm
    (``{"op": "configure"}``, ``process.retain``).

    Every object so far is frozen out of the garbage collector (``gc.freeze``, as pre-fork servers do),
    so a rank's collections and its exit-time scan for unflushed files walk only what the rank made
    itself, instead of touching, and so copying, every page of the template's heap."""
    for name in message.get("preload") or ():
        importlib.import_module(name)
    pools = Pools()
    gc.freeze()
    store.serve_on(
        fds[0] if fds else None, message.get("store_host") or "127.0.0.1", int(message.get("store_port") or 0)
    )
    return pools


def start_store(listen_fd: int, host: str, port: int) -> int:
    """Fork a process that serves a fresh store on the launcher's listening socket; its pid.

    One per attempt: torch's ranks add no per-attempt prefix to their keys (with an agent store it
    expects a new store per attempt), so the last attempt's keys must not be there for the next.
    """
    pid = os.fork()
    if pid:
        return pid
    try:
        set_pdeathsig()  # it goes with the template, which goes with the launcher
        serve_forever(listen_fd, host, port)
    finally:
        os._exit(0)


def serve_forever(listen_fd: int, host: str, port: int) -> None:
    from multigpu.rendezvous.store import serve_store

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    store = serve_store(listen_fd, host, port)
    while store is not None:
        signal.pause()


def fork_rank(
    request: dict[str, Any], fds: list[int], control: socket.socket, pools: Pools
) -> dict[str, Any]:
    """Fork the rank (twice: it ends up the launcher's child); the answer for the launcher."""
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        return {"error": "the template has threads; forking it would not be safe"}
    pid_r, pid_w = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        for fd in (pid_r, pid_w, *fds):
            os.close(fd)
        raise  # answered with its errno (``serve_requests``)
    if middle == 0:  # the middle process: fork the rank, say its pid (or fork's errno), leave
        try:
            os.close(pid_r)
            me = os.getpid()
            try:
                rank = os.fork()
            except OSError as exc:
                os.write(pid_w, f"errno {exc.errno}\n".encode())
                raise
            if rank == 0:
                os.close(pid_w)
                become_rank(request, fds, control, me, pools)  # never returns
            os.write(pid_w, f"{rank}\n".encode())
        finally:
            os._exit(0)
    os.close(pid_w)
    for fd in fds:
        os.close(fd)
    with os.fdopen(pid_r, "rb") as pipe:  # a line, not EOF: the rank holds the pipe until it runs
        text = pipe.readline().strip()
    os.waitpid(middle, 0)  # once it is gone, the rank is the launcher's child
    return fork_answer(text.decode())


def fork_answer(text: str) -> dict[str, Any]:
    """The launcher's answer from what the middle process said: the rank's pid, or why not (fork's
    errno, so that a process limit reads as one: ``supervisor.spawning.ProcessLimitError``)."""
    if text.isdigit():
        return {"pid": int(text)}
    if text.startswith("errno ") and text[6:].isdigit():
        code = int(text[6:])
        return {"error": f"the fork failed: {os.strerror(code)}", "errno": code}
    return {"error": "the fork failed"}


class Store:
    """The attempt's store process, when the template hosts the job's store."""

    def __init__(self, listen_fd: int | None, host: str, port: int) -> None:
        self.listen_fd, self.host, self.port = listen_fd, host, port
        self.pid: int | None = None

    def renew(self) -> dict[str, Any]:
        end_store(self.pid)
        self.pid = None
        if self.listen_fd is not None:
            self.pid = start_store(self.listen_fd, self.host, self.port)
        return {"store_pid": self.pid}

    def serve_on(self, listen_fd: int | None, host: str, port: int) -> None:
        """A launch's store, on its listening socket (None: this node hosts no store)."""
        self.release()
        self.listen_fd, self.host, self.port = listen_fd, host, port
        self.renew()

    def release(self) -> dict[str, Any]:
        """The launch is over: its store ends and its socket is closed, so nothing serves its port
        while the template waits, warm, for the next launch."""
        end_store(self.pid)
        self.pid = None
        if self.listen_fd is not None:
            os.close(self.listen_fd)
            self.listen_fd = None
        return {"released": True}


def serve_requests(control: socket.socket, store: Store, pools: Pools) -> None:
    while True:
        request, fds = receive(control)
        if request is None:
            return
        op = request.get("op", "fork")
        try:
            if op == "store":
                answer = store.renew()
            elif op == "configure":
                pools = setup(request, fds, store)
                answer = {"ready": True, "pid": os.getpid(), "store_pid": store.pid}
            elif op == "release":
                answer = store.release()
            else:
                answer = fork_rank(request, fds, control, pools)
        except Exception as exc:  # the launcher ends this template and starts ranks otherwise
            answer = {"error": f"{op} failed: {type(exc).__name__}: {exc}"}
            if isinstance(exc, OSError) and exc.errno is not None:
                answer["errno"] = exc.errno  # EAGAIN: a process limit (``fork_answer``)
        send(control, answer)


def end_store(pid: int | None) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m multigpu.template")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--launcher-pid", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    set_pdeathsig()
    if os.getppid() != args.launcher_pid:
        return  # the launcher is already gone
    # The launcher decides when the template and its store end. SLURM's warning (--signal=USR1@N,
    # scancel --signal) reaches every process of the step: the store's would die of it mid-agreement.
    # Ranks forked from here set their own dispositions (child.reset_signals, then the bootstrap).
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    control = socket.socket(fileno=args.control_fd)
    store: Store | None = None
    try:
        try:
            warm_up()
            configured = configure(control)
            if configured is None:
                return  # the launcher needed no template after all
            store, pools = configured
        except Exception as exc:  # the launcher falls back to plain processes and says why
            send(control, {"error": f"{type(exc).__name__}: {exc}"})
            return
        send(control, {"ready": True, "pid": os.getpid(), "store_pid": store.pid})
        serve_requests(control, store, pools)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the launcher closed the channel before we answered: it needs us no more
    finally:
        if store is not None:
            end_store(store.pid)
