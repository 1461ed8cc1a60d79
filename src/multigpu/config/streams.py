"""torchrun's ``--redirects``/``--tee`` value, parsed once: which of a rank's streams it names.

Parsed by the command line into the run configuration, read by the spec builder for each local rank;
the text is kept for a ``--logs-specs`` plugin, which parses it with torch's own ``Std.from_str``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from multigpu.contract.errors import UsageError

STREAM_BITS = {
    1: frozenset({"stdout"}),
    2: frozenset({"stderr"}),
    3: frozenset({"stdout", "stderr"}),
    0: frozenset(),
}


@dataclass(frozen=True)
class StdStreams:
    """``3`` for every rank, or ``0:1,1:2`` per local rank (torchrun's ``Std.from_str``)."""

    text: str = "0"
    every_rank: frozenset[str] = frozenset()
    per_rank: dict[int, frozenset[str]] | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, text: str, flag: str) -> StdStreams:
        def bits(value: str) -> frozenset[str]:
            if not value.strip().isdigit() or int(value) not in STREAM_BITS:
                raise UsageError(f"{flag} must be 0-3 or LOCAL_RANK:0-3,..., got {text!r}")
            return STREAM_BITS[int(value)]

        if ":" not in text:
            return cls(text, bits(text))
        per_rank: dict[int, frozenset[str]] = {}
        for item in text.split(","):
            rank, sep, value = item.partition(":")
            if not sep or not rank.strip().isdigit():
                raise UsageError(f"{flag} must be 0-3 or LOCAL_RANK:0-3,..., got {text!r}")
            per_rank[int(rank)] = bits(value)
        return cls(text, frozenset(), per_rank)

    @property
    def given(self) -> bool:
        """Not torchrun's default ``0`` (``0:0`` is given, as torchrun's file layout has it)."""
        return self.text != "0"

    def streams(self, local_rank: int) -> frozenset[str]:
        if self.per_rank is None:
            return self.every_rank
        return self.per_rank.get(local_rank, frozenset())
