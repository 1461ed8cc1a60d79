"""The fault campaign's pure parts (issue 41), run in the harness process: the Llama 3 fault mix and
its seeded draw, the time a fault cost as read from the ranks' step logs, weighted quantiles and the
projection to a 2.5 h interval between interruptions. No process, no clock: the unit tests call these.

Llama 3's 54-day run on 16,384 GPUs (The Llama 3 Herd of Models, table 5) had 419 unexpected
interruptions; each campaign class stands for the rows it can imitate on a virtual network.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

MIX: dict[str, tuple[int, str]] = {
    "gpu": (268, "faulty GPU 148, HBM3 72, SRAM 19, GPU system processor 17, SDC 6, thermal 6"),
    "software": (56, "software bug 54, dependency 2"),
    "host": (46, "host maintenance 32, SSD 3, power supply 3, chassis 2, IO board 2, CPU 2, memory 2"),
    "network": (42, "network switch/cable 35, NIC 7"),
    "hang": (7, "NCCL watchdog timeouts 7"),
    "store": (1, "no row of its own: the one store host among the job's hosts (a nominal 1 of 420)"),
}
"""class -> (interruptions it stands for, which of Llama 3's rows)."""

INJECTION = {
    "gpu": "`kill -9` of one rank",
    "software": "a Python exception in one rank",
    "host": "`kill -9` of one node's launcher",
    "network": "one node's link down (until its launcher gave up, then up; the node relaunched)",
    "hang": "`SIGSTOP` of one rank (multigpu: `--hang-timeout`)",
    "store": "the store's link down for a few seconds (torchrun: its store's node, A)",
}
BOUND_S = 20.0
"""From a fault to every rank past its lost step; later counts as never recovered (and as this much,
a lower bound, in the quantiles: in a real job it lasts until a person restarts it)."""
LLAMA_MTBI_S = 2.5 * 3600.0
"""The interval between interruptions the projection assumes: issue 41's figure for Llama 3 (466
interruptions, planned ones included, in 54 days: one every 2.8 h; 2.5 h is the rounder, harsher one)."""


def draw(seed: int, count: int) -> list[str]:
    """``count`` fault classes in a seeded random order: each class once (so every row has a number),
    the rest drawn with the mix's weights."""
    rng = random.Random(seed)
    names = list(MIX)
    picked = list(names) if count >= len(names) else rng.sample(names, count)
    weights = [MIX[n][0] for n in names]
    picked += rng.choices(names, weights=weights, k=max(0, count - len(names)))
    rng.shuffle(picked)
    return picked


@dataclass(frozen=True)
class Step:
    """One line of a rank's step log: wall time, host, step, round size and the rank's pid."""

    t: float
    host: str
    step: int
    world: int
    pid: int


STALL_GAP_S = 1.0
"""A pause this long between two step lines (any rank's) is the job stalled; a step takes ~0.07 s."""


@dataclass(frozen=True)
class Lost:
    """What one fault cost: the last step before the stall it caused, when the stall began (the fault,
    or later where the faulted node's ranks trained on a little), when every rank was past that step
    again (None: never), and how many steps the restart rolled back."""

    last_step: int
    stall_t: float
    back_t: float | None
    rolled_back: int

    @property
    def lost_s(self) -> float | None:
        return None if self.back_t is None else self.back_t - self.stall_t


def stall_start(
    steps: Sequence[Step], fault_t: float, now: float | None = None, gap: float = STALL_GAP_S
) -> float:
    """When training stopped after ``fault_t``: the last step line before the first pause of ``gap``
    (the fault's time if the pause began at once, or if there was none: training went on). Read at
    ``now`` (the harness's clock), a silence since the last line that already lasts ``gap`` is that
    pause too."""
    times = sorted(s.t for s in steps)
    prev = max((t for t in times if t <= fault_t), default=fault_t)
    for t in (t for t in times if t > fault_t):
        if t - max(prev, fault_t) > gap:
            return max(prev, fault_t)
        prev = t
    if now is not None and now - max(prev, fault_t) > gap:
        return max(prev, fault_t)
    return fault_t


def lost_after(steps: Sequence[Step], fault_t: float, now: float | None = None) -> Lost:
    """From the step logs (read at ``now``): the stall the fault caused (``stall_start``) and the
    highest step any rank logged before it; when every rank of a round was past that step again
    (``all_past``); steps rolled back = that highest step, plus one, minus the lowest step logged
    after the stall (0 when training went straight on)."""
    stall = stall_start(steps, fault_t, now)
    last = max((s.step for s in steps if s.t <= stall), default=-1)
    after = [s for s in steps if s.t > stall]
    rolled = max(0, last + 1 - min((s.step for s in after), default=last + 1))
    return Lost(last, stall, all_past(after, last), rolled)


def all_past(steps: Sequence[Step], last: int) -> float | None:
    """When every rank of a round had logged one same step past ``last`` (a round of W ranks: W hosts
    logged it): the time the last of them did; None if none has yet."""
    hosts: dict[int, dict[str, float]] = {}
    for s in sorted(steps, key=lambda s: s.t):
        if s.step <= last:
            continue
        seen = hosts.setdefault(s.step, {})
        seen.setdefault(s.host, s.t)
        if len(seen) >= s.world:
            return max(seen.values())
    return None


def weighted_quantile(samples: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile (0..1) of (value, weight) samples: the smallest value whose cumulative weight
    reaches ``q`` of the total (nearest rank)."""
    if not samples:
        return None
    ordered = sorted(samples)
    total = sum(w for _, w in ordered)
    running = 0.0
    for value, weight in ordered:
        running += weight
        if running >= q * total - 1e-12:
            return value
    return ordered[-1][0]


def mix_weighted(per_class: dict[str, list[float | None]], never_s: float) -> list[tuple[float, float]]:
    """Every sample with the weight its class has in the mix, shared among that class's samples, so
    the quantiles are the mix's, not the campaign's draw; a fault never recovered counts as
    ``never_s`` (a lower bound: the harness gave up then)."""
    out: list[tuple[float, float]] = []
    for name, values in per_class.items():
        for v in values:
            out.append((never_s if v is None else v, MIX[name][0] / len(values)))
    return out


def effective_share(mean_lost_s: float, mtbi_s: float = LLAMA_MTBI_S) -> float:
    """The share of wall time spent training when every ``mtbi_s`` of training one interruption costs
    ``mean_lost_s``."""
    return mtbi_s / (mtbi_s + mean_lost_s)
