"""One thing a process keeps warm between uses (a helper process, as a rule), in a slot of its own.

Three processes hold one: the launcher its node's sentinel (``runner/sentinel_handle.py``), the
launcher its early or kept template (``template/process.py``), and ``multigpu.launch``'s caller its
launcher (``function/launcher_handle.py``), where launches may come from several threads. One shape
for all three: started on first use (``get_or_start``), replaced when it is no longer usable, taken
whole by one user (``take``), ended once (``close``). Every move holds the slot's lock, so two threads
never start two or end one twice. Runs in whichever process holds the slot; standard library only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def _always(_: object) -> bool:
    return True


class Warm(Generic[T]):
    """A slot holding at most one ``T``; ``end`` ends one that leaves it for good (``close``, or a
    replacement in ``get_or_start``)."""

    def __init__(self, end: Callable[[T], object]) -> None:
        self._end = end
        self._lock = threading.Lock()
        self._held: T | None = None

    def get_or_start(self, start: Callable[[], T], usable: Callable[[T], bool] = _always) -> T:
        """The one held if ``usable``; else that one (if any) is ended, and ``start()``'s is held and
        returned. An error of ``start`` reaches the caller and leaves the slot empty; one held whose
        ``usable`` raises is ended, not dropped (a process no one holds would run on)."""
        with self._lock:
            held, self._held = self._held, None
            if held is not None:
                try:
                    keep = usable(held)
                except BaseException:
                    self._end(held)
                    raise
                if keep:
                    self._held = held
                    return held
                self._end(held)
            self._held = start()
            return self._held

    def held(self) -> T | None:
        """The one held now, left in the slot."""
        with self._lock:
            return self._held

    def put(self, item: T) -> bool:
        """Hold ``item`` if the slot is empty; False (and nothing changes) if it is not."""
        with self._lock:
            if self._held is not None:
                return False
            self._held = item
            return True

    def take(self) -> T | None:
        """The one held, out of the slot: the caller now owns it (uses it, ends it)."""
        with self._lock:
            held, self._held = self._held, None
            return held

    def close(self) -> None:
        """End the one held, if any; the next ``get_or_start`` starts anew. Safe twice."""
        held = self.take()
        if held is not None:
            self._end(held)
