"""What the supervisor tells its listener (run.json) and its tick hook, and how often. Runs in the
launcher (and OTX's caller), on the supervisor's loop thread, never in a signal handler.

Rank state changes are batched per loop turn: the listener rewrites run.json on each call, and one
call per rank was 64 rewrites of a growing record while 64 ranks started (0.7 s of the launcher's
time, in series with the forks). Step times go out every ``PROGRESS_EVERY_S`` and at the end.
"""

from __future__ import annotations

from collections.abc import Callable

from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.settings import Hooks
from multigpu.supervisor.states import Worker

PROGRESS_EVERY_S = 5.0
"""How often step times go to the listener (run.json), besides the end of the attempt."""


class News:
    """The listener's side of the loop: changed ranks, progress snapshots, the periodic tick."""

    def __init__(
        self, hooks: Hooks, progress: ProgressBook, clock: Callable[[], float], tick_period: float
    ) -> None:
        self._hooks, self._progress, self._clock, self._tick_period = hooks, progress, clock, tick_period
        self._changed: dict[int, Worker] = {}
        self._published = float("-inf")
        self._last_tick = 0.0

    def changed(self, worker: Worker) -> None:
        """Note a rank whose state changed; the listener hears of every change of a turn at once."""
        self._changed[worker.rank] = worker

    def tell(self) -> None:
        """One call to the listener with every change since the last (none: no call)."""
        changed, self._changed = list(self._changed.values()), {}
        if changed and self._hooks.listener is not None:
            self._hooks.listener.on_workers_change(changed)

    def publish(self, final: bool = False) -> None:
        """Hand every rank's step times to the listener, and keep the learned timeouts (``final``:
        saved whatever the interval)."""
        self._published = self._clock()
        self._progress.maybe_save(self._published, force=final)
        on_progress = getattr(self._hooks.listener, "on_progress", None)
        if on_progress is not None:
            on_progress(self._progress.snapshot())

    def tick(self, closing: bool) -> None:
        """Once per loop turn: progress when it is due, and the tick hook (the live view)."""
        now = self._clock()
        if now - self._published >= PROGRESS_EVERY_S:
            self.publish(final=closing)
        if self._hooks.tick is not None and now - self._last_tick >= self._tick_period:
            self._last_tick = now
            self._hooks.tick()
