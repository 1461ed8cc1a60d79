"""The launcher's own lines as log records, and where they are shown: ``multigpu: <message>``.

Every module writes its lines through ``logging.getLogger(__name__)``, all under the ``multigpu``
logger (set to INFO here, unless the application set a level first); nothing hands a callable around.
Two handlers on that logger turn a record into a console line, one at a time:

* a run's (``lines_through``): for the duration of ``multigpu run`` (``runner/attempts.py``) every
  record goes through its ``Console``, so it keeps its place among the ranks' lines and no stalled
  console holds the launcher;
* the stand-in, installed when this module is first imported: outside a run (function mode's caller,
  OTX's manager, a library user) a record goes straight onto stderr, as Python's own last resort would
  print a warning, but at INFO and in our wording; and only where nothing else prints it: when the
  application configured logging (its ``logging.basicConfig``, pytest's ``caplog``), its handlers show
  the record, once.

Records always propagate, so the application's handlers and ``caplog`` see every one. Runs in the
launcher and in function mode's caller; any thread may log (the loop, the fate monitor's, a store's):
a handler's lock orders its writes, and a ``Console`` is thread-safe.
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
    """One launcher line straight onto stderr, never raising: the stand-in's output, and a run's lines
    before its console writer starts or once it closed (``Console.say``)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(f"multigpu: {message}\n")
        sys.stderr.flush()


class _RunLines(logging.Handler):
    """A run's handler: every record onto its console (``Console.say``)."""

    shows_launcher_lines = True  # a mark, not a class: a reloaded module's classes are new ones

    def __init__(self, console: Saying) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.say(record.getMessage())
        except Exception:
            self.handleError(record)


class _StandIn(logging.Handler):
    """Outside a run: a record onto stderr, unless a run's handler or the application's shows it."""

    shows_launcher_lines = True

    def emit(self, record: logging.LogRecord) -> None:
        if any(isinstance(h, _RunLines) for h in PACKAGE.handlers) or _shown_elsewhere(record):
            return
        try:
            line_on_stderr(record.getMessage())
        except Exception:
            self.handleError(record)


def _shown_elsewhere(record: logging.LogRecord) -> bool:
    """Whether a handler not ours takes ``record`` on its way up (``logging.Logger.callHandlers``)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        for handler in logger.handlers:
            ours = getattr(handler, "shows_launcher_lines", False)
            if not ours and record.levelno >= handler.level:
                return True
        logger = logger.parent if logger.propagate else None
    return False


@contextlib.contextmanager
def lines_through(console: C) -> Iterator[C]:
    """For the block's duration, every launcher line goes through ``console`` (one ``multigpu run``);
    the stand-in is silent meanwhile. The handler is removed however the block ends."""
    handler = _RunLines(console)
    PACKAGE.addHandler(handler)
    try:
        yield console
    finally:
        PACKAGE.removeHandler(handler)


def _install() -> None:
    """The package logger's level and its stand-in, once per process (a reload adds no second one)."""
    if PACKAGE.level == logging.NOTSET:
        PACKAGE.setLevel(logging.INFO)
    if not any(getattr(h, "shows_launcher_lines", False) for h in PACKAGE.handlers):
        PACKAGE.addHandler(_StandIn())


_install()
