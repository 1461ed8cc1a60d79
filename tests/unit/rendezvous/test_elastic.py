"""The eviction of silent launchers from torch's rendezvous state, on a real c10d store.

Run in a child process: torch's store and rendezvous keep process-wide descriptors the hygiene fixture
would rightly count as leaks of this test process.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from helpers import PYTHON, clean_env

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
