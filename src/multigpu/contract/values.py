"""The one parser of each kind of value a user types: seconds, integers, numbers, signal lists.

Shared by every process (the command line, function mode's arguments, and the rank, which reads the
warning signals from its environment), so it needs the standard library only. Each raises
``UsageError`` (a ``ValueError``) with a message that names the option, so the CLI prints it as one line.
"""

from __future__ import annotations

import math
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multigpu.contract.errors import UsageError


WAIT_LINE_EVERY_S = 30.0
"""A node that waits for its peers (to join, for the store's host, for a round) says so at once, then
this often: each line names who is there, who is missing and the time left."""


def duration_text(seconds: float) -> str:
    """``45s``, ``9m58s``, ``1h02m``: a time left, as a person reads it (the one way it is written)."""
    total = max(0, int(seconds))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def seconds(value: str, flag: str, *, positive: bool = False) -> float:
    """A number of seconds; at least 0, or more than 0 with ``positive``."""
    try:
        number = float(value)
    except ValueError:
        raise _usage(f"{flag} must be a number of seconds, got {value!r}") from None
    if math.isnan(number) or number < 0 or (positive and number == 0):
        raise _usage(f"{flag} must be {'more than' if positive else 'at least'} 0, got {value}")
    return number


def integer(value: str, flag: str, minimum: int) -> int:
    """An integer of at least ``minimum``."""
    try:
        number = int(value)
    except ValueError:
        raise _usage(f"{flag} must be an integer, got {value!r}") from None
    if number < minimum:
        raise _usage(f"{flag} must be at least {minimum}, got {number}")
    return number


def number(value: str, flag: str, minimum: float, what: str) -> float:
    """A finite number of at least ``minimum``; ``what`` says what it means, in the one-line error."""
    try:
        parsed = float(value)
    except ValueError:
        parsed = math.nan
    if not minimum <= parsed < math.inf:
        raise _usage(f"{flag} must be a number of at least {minimum:g}{what}, got {value!r}")
    return parsed


def module_names(text: str, flag: str) -> tuple[str, ...]:
    """``json, torch.nn`` -> module names, in order; one that is not a dotted name is named."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if not all(part.isidentifier() for part in m.split("."))]
    if bad:
        raise _usage(f"{flag} takes module names, comma separated; got {bad[0]!r}")
    return names


def signal_numbers(text: str, flag: str) -> tuple[int, ...]:
    """``SIGUSR1,USR2`` -> signal numbers, in order and without repeats; a bad name is named."""
    found: list[int] = []
    for item in (part.strip().upper() for part in text.split(",")):
        if not item:
            continue
        name = item if item.startswith("SIG") else "SIG" + item
        try:
            number = int(signal.Signals[name])
        except KeyError:
            raise _usage(f"{flag}: {item!r} is not a signal name like USR1") from None
        if number not in found:
            found.append(number)
    return tuple(found)


def signal_names(numbers: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(signal.Signals(n).name for n in numbers)


def _usage(message: str) -> UsageError:
    from multigpu.contract.errors import UsageError  # only for a mistake: the rank's start-up stays lean

    return UsageError(message)
