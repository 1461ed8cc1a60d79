"""The launcher's own lines as log records, and where they are shown: ``multigpu: <message>``.

Every module writes its lines through ``logging.getLogger(__name__)``, all under the ``multigpu``
logger (set to INFO here, unless the application set a level first); nothing hands a callable around.
ONE handler on that logger, installed once per process (the package's ``__init__`` imports this
module, so any process that imports any part of multigpu has it), turns a record into a console line:

* during a run (``lines_through``, for the duration of ``multigpu run``: ``runner/attempts.py``) every
  record goes through the run's ``Console``, so it keeps its place among the ranks' lines and no stalled
  console holds the launcher;
* outside a run (OTX's manager, a library user) a record goes straight onto stderr, as Python's own
  last resort would print a warning, but at INFO and in our wording; and only where nothing else prints
  it: when the application configured logging (its ``logging.basicConfig``, pytest's ``caplog``), its
  handlers show the record, once.

Where a record goes is decided inside the one handler, under one lock, from the run's console set by
``lines_through``: the logger's handler list never changes during a run, so a thread that logs while a
run begins or ends prints its line exactly once (a handler added or removed while another thread walks
the list could lose a line or print it twice). Records always propagate, so the application's handlers
and ``caplog`` see every one. Runs in the launcher and in OTX's caller; any thread may log.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Protocol, TypeVar

PACKAGE = logging.getLogger("multigpu")


class Saying(Protocol):
    """What a run's lines go through: ``writer.Console`` (which imports this module)."""

    def say(self, message: str) -> None: ...


C = TypeVar("C", bound=Saying)


def line_on_stderr(message: str) -> None:
    """One launcher line straight onto stderr, never raising: outside a run, and a run's lines before
    its console writer starts or once it closed (``Console.say``)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(f"multigpu: {message}\n")
        sys.stderr.flush()


class _Lines(logging.Handler):
    """The package's one handler: a record onto the run's console, or onto stderr where no run is and
    no handler of the application's shows it."""

    shows_launcher_lines = True  # a mark, not a class: a reloaded module's classes are new ones

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[Saying] = []
        """The consoles of the runs under way, innermost last (``lines_through``); read under the lock."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self.runs:
                self.runs[-1].say(record.getMessage())
            elif not _shown_elsewhere(record):
                line_on_stderr(record.getMessage())
        except Exception:
            self.handleError(record)


def _shown_elsewhere(record: logging.LogRecord) -> bool:
    """Whether a handler not ours takes ``record`` on its way up (``logging.Logger.callHandlers``)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        for handler in logger.handlers:
            ours = getattr(handler, "shows_launcher_lines", False)
            if not ours and record.levelno >= handler.level and handler.filter(record):
                return True
        logger = logger.parent if logger.propagate else None
    return False


def _handler() -> _Lines:
    """The package's handler, installed now if this process has none yet (a reload adds no second)."""
    for handler in PACKAGE.handlers:
        if getattr(handler, "shows_launcher_lines", False):
            return handler  # type: ignore[return-value]
    handler = _Lines()
    PACKAGE.addHandler(handler)
    return handler


def keep_enabled() -> None:
    """Undo ``logging.config``'s disabling of the package's loggers (its ``disable_existing_loggers``
    default silences every logger created before the application configured logging, ours included):
    called where multigpu starts work in a process the application configured (OTX's manager), so that
    no failure line is lost without a word."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "multigpu" or name.startswith("multigpu.")):
            logger.disabled = False


@contextlib.contextmanager
def lines_through(console: C) -> Iterator[C]:
    """For the block's duration, every launcher line goes through ``console`` (one ``multigpu run``);
    afterwards they go where they went before, however the block ends."""
    handler = _handler()
    keep_enabled()
    with handler.lock or contextlib.nullcontext():
        handler.runs.append(console)
    try:
        yield console
    finally:
        with handler.lock or contextlib.nullcontext():
            handler.runs.remove(console)


def install() -> None:
    """The package logger's level and its one handler, once per process."""
    if PACKAGE.level == logging.NOTSET:
        PACKAGE.setLevel(logging.INFO)
    _handler()


install()
