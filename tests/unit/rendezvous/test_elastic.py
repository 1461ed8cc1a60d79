"""The eviction of silent launchers from torch's rendezvous state, on a real c10d store.

Run in a child process: torch's store and rendezvous keep process-wide descriptors the hygiene fixture
would rightly count as leaks of this test process.
"""

from __future__ import annotations

import subprocess
import textwrap
import threading
import time

import pytest

from helpers import PYTHON, clean_env
from multigpu.rendezvous import elastic_fixes
from multigpu.rendezvous.elastic import ElasticRendezvous

pytestmark = pytest.mark.integration

SCENARIO = """
    import pickle
    from datetime import datetime, timedelta, timezone

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from multigpu.rendezvous.elastic_fixes import Liveness, LivenessPace

    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    backend = C10dRendezvousBackend(store, "job")
    me, dead, alive, torchrun = (dr._NodeDesc("127.0.0.1", pid, 0) for pid in (101, 202, 303, 404))
    state = dr._RendezvousState()
    state.complete = True
    fresh = datetime.now(timezone.utc)
    for rank, node in enumerate((me, dead, alive, torchrun)):
        state.participants[node] = rank
        state.last_heartbeats[node] = fresh
    backend.set_state(pickle.dumps(state))
    clock = Clock()
    liveness = Liveness(store, backend, "job", me, pace=LivenessPace(lost_after_s=3.0, clock=clock))
    for node in (dead, alive):
        store.add(liveness.key(node), 1)  # the torchrun node never beats on our keys

    def beats():
        return pickle.loads(backend.get_state()[0]).last_heartbeats

    liveness.evict_silent()
    clock.now += 2.0
    store.add(liveness.key(alive), 1)
    liveness.evict_silent()
    print("after 2s:", beats()[dead] == fresh)
    clock.now += 2.0
    store.add(liveness.key(alive), 1)
    liveness.evict_silent()
    after = beats()
    print("after 4s dead aged:", after[dead] == datetime.fromtimestamp(0, timezone.utc))
    print("others untouched:", after[me] == after[alive] == after[torchrun] == fresh)
"""


def test_only_a_launcher_whose_beats_stopped_is_aged_out_of_torchs_state() -> None:
    result = subprocess.run(
        [PYTHON, "-c", textwrap.dedent(SCENARIO)], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    expected = ["after 2s: True", "after 4s dead aged: True", "others untouched: True"]
    assert result.stdout.splitlines() == expected


class _Liveness:
    def stop(self) -> None:
        pass


class _Handler:
    """torch's handler over a cut link: its close blocks until the link returns (here: ``back``)."""

    def __init__(self) -> None:
        self.back = threading.Event()
        self.closing = 0

    def shutdown(self) -> bool:
        self.closing += 1
        self.back.wait(10)
        return True


def _rendezvous(store_failed: bool) -> ElasticRendezvous:
    rdzv = ElasticRendezvous.__new__(ElasticRendezvous)  # the shutdown path only: no torch, no store
    rdzv.liveness, rdzv.handler, rdzv.store_failed = _Liveness(), _Handler(), store_failed  # type: ignore[assignment]
    return rdzv


def test_closing_the_rendezvous_is_bounded_in_time_and_skipped_when_the_store_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 41: torch's close is several store calls with no time-out; over a cut link it held the
    launcher 22-24 s after the link came back, and then closed the rendezvous for every node."""
    monkeypatch.setattr(elastic_fixes, "CLOSE_WAIT_S", 0.2)
    rdzv = _rendezvous(store_failed=False)
    began = time.monotonic()
    rdzv.shutdown(close=True)
    assert time.monotonic() - began < 2.0 and rdzv.handler.closing == 1
    rdzv.handler.back.set()
    failed = _rendezvous(store_failed=True)
    failed.shutdown(close=True)
    assert failed.handler.closing == 0, "a node whose store failed leaves the rendezvous open"


PACE = """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from multigpu.rendezvous.elastic_fixes import pace_polls

    asked = []
    dr._delay = asked.append  # torch's own delay, as pace_polls finds it
    assert pace_polls(4) == 0.1
    dr._delay(1)  # the poll of a node waiting for its round
    dr._delay((0, 0.3))  # the first round's skew: kept
    assert pace_polls(5000) == 1.0  # a big job: never faster than torch's own pace
    dr._delay(1)
    print(asked)
"""


def test_a_waiting_node_polls_torchs_state_at_a_pace_scaled_by_the_job() -> None:
    """torch reads a round's state once a second: a restart cost 2 s of polls on three nodes. The
    poll is 0.1 s for a small job, and no faster than torch's for 1,000 nodes and more."""
    out = subprocess.run(
        [PYTHON, "-c", textwrap.dedent(PACE)], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[0.1, (0, 0.3), 1.0]", out.stdout
