"""A fake clock, ranks and a progress book for the observe tests: no processes."""

from __future__ import annotations

from typing import Any

from multigpu.contract.beats import Beat
from multigpu.observe.watched import Watched
from multigpu.supervisor.hangs.book import HangPolicy, ProgressBook
from multigpu.supervisor.states import Worker, WorkerSpec, WorkerState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ranks(count: int, ceiling: float | None = 8.0) -> tuple[list[Worker], ProgressBook, Clock]:
    """``count`` running ranks (none has stepped yet) and their book on a fake clock."""
    clock = Clock()
    book = ProgressBook(
        HangPolicy(ceiling=ceiling, floor=2.0), range(count), clock=clock, wall=lambda: 5000.0
    )
    workers = [Worker(WorkerSpec(rank=r, local_rank=r, argv=[], env={})) for r in range(count)]
    for w in workers:
        w.to(WorkerState.RUNNING)
    return workers, book, clock


def steps(book: ProgressBook, clock: Clock, count: int, interval: float, ranks: tuple[int, ...]) -> None:
    """``count`` steps of ``interval`` seconds by each of ``ranks`` (steps numbered on from the last)."""
    for _ in range(count):
        clock.now += interval
        for r in ranks:
            last = book.ranks[r].step
            book.feed(r, [Beat("step", value=float(0 if last is None else last + 1))], clock.now)


def watched(record: dict[str, Any] | None = None, **kwargs: Any) -> Watched:
    return Watched("run-1", 0, record if record is not None else {"attempts": [], "incidents": []}, **kwargs)
