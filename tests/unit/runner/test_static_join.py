"""Issue 31: the waiting lines of a node (``runner/static_join.py``): what a node says while it waits for
the others to join, when it gives up, and on Ctrl-C; the elastic round's line beside it. No processes."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import logged
from multigpu.config.run import RendezvousConfig, RunConfig
from multigpu.contract.errors import Interrupted, RendezvousError
from multigpu.contract.values import duration_text
from multigpu.runner.static_join import JoinWait, wait_line


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (45.9, "45s"), (598, "9m58s"), (3720, "1h02m"), (-3, "0s")]
)
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


def test_wait_line() -> None:
    assert wait_line(1, [1], [0], 598.4) == (
        "node 1: waiting for node(s) 0 (joined: 1); 9m58s left (--rdzv-timeout)"
    )
    assert wait_line(0, [0, 2], [1, 3], 5) == (
        "node 0: waiting for node(s) 1, 3 (joined: 0, 2); 5s left (--rdzv-timeout)"
    )


class _Job:
    """A JobStore stand-in: its members, and a join that polls ``on_wait`` with the given times left."""

    def __init__(self, members: dict[int, int], lefts: list[float], interrupt: bool = False) -> None:
        self._members, self._lefts, self._interrupt = members, lefts, interrupt

    def members(self) -> dict[int, int]:
        return self._members

    def join(self, timeout_s: float, on_wait: Any = None) -> None:
        for left in self._lefts:
            on_wait(left)
        if self._interrupt:
            raise KeyboardInterrupt


def _wait(job: _Job, clock: list[float]) -> JoinWait:
    config = RunConfig(
        target="t.py", nproc=1, world_size=3, nnodes=3, node_rank=0, rdzv=RendezvousConfig(timeout=600)
    )
    return JoinWait(config, job, clock=lambda: clock[0])  # type: ignore[arg-type]


def test_the_wait_is_said_after_a_second_then_every_30_s(caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    job = _Job({0: 0, 2: 2}, [])
    wait = _wait(job, clock)
    for now, left in [
        (100.0, 599.9),
        (100.9, 599.1),
        (101.0, 599.0),
        (110.0, 590.0),
        (130.9, 569.1),
        (131.0, 569.0),
        (150.0, 550.0),
    ]:
        clock[0] = now
        wait(left)
    assert logged(caplog) == [
        "node 0: waiting for node(s) 1 (joined: 0, 2); 9m59s left (--rdzv-timeout)",
        "node 0: waiting for node(s) 1 (joined: 0, 2); 9m29s left (--rdzv-timeout)",
    ]


def test_the_time_out_names_the_missing_nodes() -> None:
    wait = _wait(_Job({0: 0}, [599.0, 0.0]), [0.0])
    with pytest.raises(RendezvousError, match=r"^node\(s\) 1, 2 never joined within 600s \(--rdzv-timeout\)"):
        wait.join()


def test_a_ctrl_c_while_waiting_is_one_line() -> None:
    wait = _wait(_Job({0: 0, 1: 1}, [599.0], interrupt=True), [0.0])
    with pytest.raises(Interrupted) as caught:
        wait.join()
    assert str(caught.value) == (
        "node 0: interrupted (SIGINT) while waiting for node(s) 2 to join (joined: 0, 1); no rank was started"
    )


def test_the_elastic_round_wait_line() -> None:
    from multigpu.rendezvous.round_wait import round_wait_line

    config = RunConfig(target="t.py", rdzv=RendezvousConfig(min_nodes=2, max_nodes=3))
    assert round_wait_line(["n1 pid 7"], config, 297.5) == (
        "waiting for 1 more node(s) for the round (2:3 nodes; joined: n1 pid 7); 4m57s left (join_timeout)"
    )
    assert round_wait_line(["n1 pid 7", "n2 pid 9"], config, 100).startswith(
        "the round has its 2 node(s); waiting for more up to last_call_timeout (2:3 nodes; joined: n1 pid 7, "
        "n2 pid 9)"
    )


def test_the_round_wait_lists_only_live_nodes() -> None:
    """A launcher killed after the round formed stays in torch's state until a sync sweeps it: the
    line must not call it joined. Torch's keep-alive judges a node that never beats on our keys (a
    torchrun); our beat counters, read at each look, judge the others at once."""
    import pickle
    from datetime import datetime, timedelta, timezone

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from multigpu.rendezvous.round_wait import RoundWait

    live, killed, aged, waiting, stopped = (dr._NodeDesc("127.0.0.1", pid, 0) for pid in (11, 22, 33, 44, 55))
    state = dr._RendezvousState()
    now = datetime.now(timezone.utc)
    state.participants.update({live: 0, killed: 1, aged: 2, stopped: 3})
    state.wait_list.add(waiting)
    state.last_heartbeats.update(
        {live: now, killed: now - timedelta(seconds=20), aged: datetime.fromtimestamp(0, timezone.utc)}
    )
    state.last_heartbeats.update({waiting: now - timedelta(seconds=2), stopped: now})

    class Backend:
        def get_state(self) -> tuple[bytes, object]:
            return pickle.dumps(state), object()

    class Beats:  # ``Liveness``'s keys on the job's store: the node 55's launcher was just kill -9ed
        counts = {11: 1, 44: 1, 55: 7}
        store = None

        def key(self, node: dr._NodeDesc) -> str:
            return str(node.pid)

        def check(self, keys: list[str]) -> bool:
            return int(keys[0]) in self.counts

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [str(self.counts[int(k)]).encode() for k in keys]

    config = RunConfig(target="t.py", rdzv=RendezvousConfig(min_nodes=2, max_nodes=3))
    torch_only = RoundWait(Backend(), config, 300.0)
    assert torch_only.joined() == ["127.0.0.1 pid 11", "127.0.0.1 pid 44", "127.0.0.1 pid 55"]
    beats = Beats()
    beats.store = beats  # type: ignore[assignment]
    wait = RoundWait(Backend(), config, 300.0, alive=(beats, 15.0))
    first = wait.joined()  # the first look: nothing to compare with yet
    assert first == ["127.0.0.1 pid 11", "127.0.0.1 pid 44", "127.0.0.1 pid 55"]
    beats.counts = {11: 12, 44: 11, 55: 7}  # two seconds on: 55 beat no more
    assert wait.joined() == ["127.0.0.1 pid 11", "127.0.0.1 pid 44"]
    assert wait.last == "joined: 127.0.0.1 pid 11, 127.0.0.1 pid 44"
