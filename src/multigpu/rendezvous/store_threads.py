"""The launcher's threads that call torch's store, and a way out that never aborts under one of them.

Runs in the launcher (and function mode's caller). A store call over a slow or dead link can outlast
the attempt that made it: the fate beat, node lateness, the elastic liveness beat, the rendezvous
close, the round-wait line, the hang exchange and the bounded calls of ``failure_sharing`` all run on
daemon threads that are waited for a bounded time only. A daemon thread whose C++ store call returns
while the interpreter finalizes cannot take the GIL back and is unwound from inside torch's C++: the
process dies with "terminate called without an active exception" (SIGABRT, exit -6), a C++ line on
the console and a wrong verdict. So every such thread is made here (``store_thread``); at exit the
launcher waits a bounded time for the ones still running (``settle``) and, if one is still inside
a call, leaves without finalizing (``leave``): its atexit handlers and buffered output first, then
``os._exit`` with the job's exit code.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 1.0
"""The longest the launcher waits at exit for its store threads to return (a round trip or two over a
slow link); one stuck on a dead link is then left, and the launcher leaves without finalizing."""


class Stopped(Exception):
    """A store thread was asked to stop between two of its calls: it makes no more."""


PUBLISH_TIMEOUT_S = 1.0
"""The longest a launcher waits for one store call it cannot do without an answer (``bounded``)."""

_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def store_thread(target: Callable[..., object], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread (not started) that makes store calls, known to ``settle`` at exit."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _THREADS.add(thread)
    return thread


def bounded(call: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    """A store call over a cut link blocks with no time-out, so it gets a thread and a bound; None
    when it did not answer in time (or failed: the store is gone too, what we know locally stands)."""
    answer: list[dict[str, Any] | None] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            answer.append(call())

    thread = store_thread(run, "multigpu-store-call")
    thread.start()
    thread.join(PUBLISH_TIMEOUT_S)
    return answer[0] if answer else None


def running() -> list[threading.Thread]:
    """The store threads still alive, this one aside."""
    me = threading.current_thread()
    return [thread for thread in list(_THREADS) if thread.is_alive() and thread is not me]


def settle(timeout_s: float = EXIT_WAIT_S) -> list[threading.Thread]:
    """Wait up to ``timeout_s`` in all for the store threads to return; those still running."""
    deadline = time.monotonic() + timeout_s
    for thread in running():
        thread.join(max(0.0, deadline - time.monotonic()))
    return running()


def leave(code: int, timeout_s: float = EXIT_WAIT_S) -> int:
    """The launcher's last step, after everything it started has ended and its record is written:
    ``code`` back for an ordinary exit when no store thread is left, else the exit without
    finalization (``os._exit``), after what finalization would do for us (atexit handlers, logging's
    included; every buffered file flushed), so nothing is lost and the verdict stays ``code``."""
    stuck = settle(timeout_s)
    if not stuck:
        return code
    logger.debug(f"leaving with {', '.join(t.name for t in stuck)} inside a store call")
    from multigpu.rank.exiting import flush_open_files

    atexit.unregister(settle)  # waited for already
    flush_open_files()  # first: an exit handler (``cli/main``'s gc.freeze) hides older files from gc
    try:
        atexit._run_exitfuncs()
    finally:
        flush_open_files()
        os._exit(code)


atexit.register(settle)  # function mode's caller: its store threads get the same bounded wait
