"""A rank's heartbeat pipe, as the supervisor's loop reads it: the beats decoded
(``contract/beats.BeatDecoder``) into the ``book.ProgressBook`` and into the rank's own record (its
script finished, its stacks or flight record written), and the pipe closed at its end.

Runs in the launcher (and OTX's caller), on the supervisor's loop; the rank's side is
``rank/progress.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from multigpu.supervisor.events import Events, read_ready
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.states import Worker


def read_beats(worker: Worker, events: Events, book: ProgressBook, clock: Callable[[], float]) -> set[str]:
    """What the rank's heartbeat pipe holds now, fed to the book; the kinds of beat that came (none
    when nothing is there, or at the pipe's end: then it is closed and forgotten)."""
    fd = worker.heartbeat_read_fd
    data = b"" if fd is None else read_ready(fd)
    if data is None or fd is None:
        return set()
    if not data:
        events.forget(fd, close=True)
        worker.heartbeat_read_fd = None
        return set()
    return feed_beats(book, worker, data, clock())


def feed_beats(book: ProgressBook, worker: Worker, data: bytes, now: float) -> set[str]:
    """Decode a rank's beats into the book and the rank's record; the kinds of beat that came."""
    beats = worker.decoder.feed(data)
    book.feed(worker.rank, beats, now)
    kinds = {b.kind for b in beats}
    worker.finished |= "done" in kinds
    worker.dumps.recorded |= "dumped" in kinds
    worker.dumps.stacked |= "stacks" in kinds
    return kinds
