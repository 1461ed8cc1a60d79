"""Function mode's parts without processes: hyper-parameter objects, the one error record, the spec
builder in function mode, and delivery into a waiting main thread."""

from __future__ import annotations

import enum
import json
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from multigpu.config.run import RunConfig
from multigpu.contract.errors import WorkerFailedError
from multigpu.contract.failure import RankIdentity, WorkerFailure
from multigpu.otx import interrupt_caller as delivery
from multigpu.otx.argv import flatten_parameters
from multigpu.otx.interrupt_caller import FailureDelivery, hook_collective_errors
from multigpu.rendezvous.failure_sharing import failure_from_record, failure_record
from multigpu.runner.specs import AttemptContext, build_specs

# ---- hyper-parameters: a mapping or OTX's ConfigurableParameters -------------------------------------


class Group:
    """Shaped like OTX's ParameterGroup: metadata next to values, and lists naming both kinds."""

    def __init__(self, header: str, parameters: dict[str, Any], groups: dict[str, Group] | None = None):
        self.header = header
        self.description = "shown in the UI only"
        self.visible_in_ui = True
        for name, value in {**parameters, **(groups or {})}.items():
            setattr(self, name, value)
        self.parameters = list(parameters)
        self.groups = list(groups or {})


class Mode(enum.Enum):
    FAST = "fast"


def test_otx_configurable_parameters_become_dotted_names() -> None:
    params = Group(
        "Root",
        {},
        {
            "learning_parameters": Group("Learning", {"learning_rate": 0.01, "batch_size": 8}),
            "algo_backend": Group("Backend", {"mode": Mode.FAST}, {"nested": Group("N", {"flag": False})}),
        },
    )
    assert flatten_parameters(params) == {
        "learning_parameters.learning_rate": 0.01,
        "learning_parameters.batch_size": 8,
        "algo_backend.mode": "fast",
        "algo_backend.nested.flag": False,
    }


def test_plain_objects_and_mappings() -> None:
    class Plain:
        def __init__(self) -> None:
            self.lr = 0.1
            self._private = "skipped"
            self.sub = type("Sub", (), {})()
            self.sub.momentum = 0.9

    assert flatten_parameters(Plain()) == {"lr": 0.1, "sub.momentum": 0.9}
    assert flatten_parameters({"a.b": 1, "c": {"d": "x"}}) == {"a.b": 1, "c.d": "x"}


@pytest.mark.parametrize("bad", [{"x": [1, 2]}, 42])
def test_unusable_hyper_parameters_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="hyper-parameter"):
        flatten_parameters(bad)


# ---- the one error record ----------------------------------------------------------------------------


def _failure() -> WorkerFailure:
    return WorkerFailure(
        rank=2,
        local_rank=1,
        pid=123,
        exit_code=1,
        node=1,
        error_type="ValueError",
        message="boom",
        traceback="Traceback...\nValueError: boom\n",
        time=1.5,
        log_tail=[f"line {i}" for i in range(20)],
        log_path="/x/rank_2.log",
    )


def test_record_round_trips_through_dict_and_file(tmp_path: Path) -> None:
    failure = _failure()
    assert WorkerFailure.from_dict(failure.to_dict()) == failure
    failure.write(tmp_path / "error.json")
    assert WorkerFailure.read(tmp_path / "error.json") == failure
    assert list(tmp_path.iterdir()) == [tmp_path / "error.json"]  # no temporary file left


def test_record_from_exception_and_the_supervisor_view(tmp_path: Path) -> None:
    try:
        raise KeyError("missing")
    except KeyError as exc:
        record = WorkerFailure.from_exception(exc, env={"RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1"})
    assert (record.rank, record.local_rank, record.node, record.error_type) == (3, 1, 1, "KeyError")
    assert "KeyError: 'missing'" in (record.traceback or "")
    record.write(tmp_path / "e.json")
    assert WorkerFailure.read(tmp_path / "e.json") == record  # what the supervisor reads back
    ended = WorkerFailure.from_exit(RankIdentity(3, 1, 1, record.pid), -9, record, log_path="rank_3.log")
    assert (ended.signal, ended.exit_code, ended.error_type, ended.traceback) == (
        "SIGKILL",
        None,
        "KeyError",
        record.traceback,
    )
    exited = WorkerFailure.from_exit(RankIdentity(3, 1, 1, None), 2)
    assert exited.describe() == "rank 3 (node 1, pid None) exited with code 2"


def test_record_reads_older_keys_torch_record_files_and_garbage(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text(json.dumps({"type": "OSError", "message": "m", "rank": "4"}))
    old = WorkerFailure.read(tmp_path / "old.json")
    assert old is not None and old.error_type == "OSError" and old.rank == 4
    torch_record = {
        "message": {
            "message": "RuntimeError: x",
            "extraInfo": {"py_callstack": "Traceback (torch)", "timestamp": "17"},
        }
    }
    (tmp_path / "torch.json").write_text(json.dumps(torch_record))
    from_torch = WorkerFailure.read(tmp_path / "torch.json")
    assert from_torch is not None and from_torch.traceback == "Traceback (torch)" and from_torch.time == 17
    (tmp_path / "bad.json").write_text("{not json")
    assert WorkerFailure.read(tmp_path / "bad.json") is None
    assert WorkerFailure.read(tmp_path / "absent.json") is None and WorkerFailure.read(None) is None


def test_fate_shares_the_same_record_with_a_short_tail() -> None:
    failure = _failure()
    shared = failure_record(failure)
    assert shared["log_tail"] == failure.log_tail[-10:]
    back = failure_from_record(shared)
    assert back.rank == 2 and back.traceback == failure.traceback and back.log_tail == failure.log_tail[-10:]
    assert failure_from_record({"message": "lost"}).rank == -1


# ---- the one spec builder, in function mode ----------------------------------------------------------


def test_function_mode_specs_start_local_ranks_after_the_caller(tmp_path: Path) -> None:
    config = RunConfig(
        target=str(tmp_path / "payload.pkl"),
        function=True,
        first_local_rank=1,
        nproc=3,
        base_rank=3,
        world_size=6,
    )
    specs = build_specs(config, AttemptContext("r", tmp_path, 0, "127.0.0.1", 1234, launcher_pid=1), {})
    assert [(s.rank, s.local_rank) for s in specs] == [(4, 1), (5, 2)]
    for spec in specs:
        assert spec.argv[-3:] == ["multigpu.rank", "function", str(tmp_path / "payload.pkl")]
        assert spec.env["RANK"] == str(spec.rank) and spec.env["MULTIGPU_ANNOUNCE_FAILURE"] == "1"


# ---- delivery into the thread that called setup -------------------------------------------------------


def _error() -> WorkerFailedError:
    return WorkerFailedError(
        WorkerFailure(rank=1, local_rank=1, pid=7, exit_code=1, error_type="E", message="m", traceback="tb")
    )


def test_a_sleeping_main_thread_is_woken_with_the_error() -> None:
    previous = signal.getsignal(delivery.DELIVERY_SIGNAL)
    target = FailureDelivery()
    target.arm()
    error = _error()
    sender = threading.Timer(0.2, target.deliver, args=(error,))
    try:
        sender.start()
        with pytest.raises(WorkerFailedError) as info:
            time.sleep(30)  # woken like Ctrl-C wakes it; the test's own timeout bounds a failure
        assert info.value is error and target.delivered
    finally:
        sender.join()
        target.disarm()
    assert signal.getsignal(delivery.DELIVERY_SIGNAL) == previous
    assert target.deliver(_error()) is False  # one error per run: the first is kept


def _frames(*modules: str) -> Any:
    frame = None
    for name in reversed(modules):  # outermost last
        frame = SimpleNamespace(f_globals={"__name__": name}, f_back=frame)
    return frame


def test_the_handler_declines_inside_multigpu_and_after_disarm() -> None:
    target = FailureDelivery()
    target.error = _error()
    # finalize() waiting in the standard library: multigpu's machinery is lower on the stack
    target._handle(delivery.DELIVERY_SIGNAL, _frames("threading", "multigpu.otx.manager", __name__))
    target._handle(delivery.DELIVERY_SIGNAL, _frames("multigpu.supervisor.loop", __name__))  # ours
    assert not target.delivered
    with pytest.raises(WorkerFailedError):  # the user's own frames: it lands
        target._handle(delivery.DELIVERY_SIGNAL, _frames("json", __name__))
    target.delivered = False
    with pytest.raises(WorkerFailedError):  # the demo application is the user's side too
        target._handle(delivery.DELIVERY_SIGNAL, _frames("multigpu.cli.demo", __name__))
    target.delivered = False
    target._stop.set()  # disarming: never again
    target._handle(delivery.DELIVERY_SIGNAL, _frames(__name__))
    assert not target.delivered


def test_a_collective_error_is_explained_by_the_known_failure() -> None:
    target = FailureDelivery()
    error = _error()
    target.deliver(error)  # not armed: recorded only, no signal
    backend = RuntimeError("Connection closed by peer")
    with pytest.raises(WorkerFailedError) as info:
        target.explain(backend)
    assert info.value is error and info.value.__cause__ is backend


def test_the_collective_hook_is_undone() -> None:
    from torch.distributed import c10d_logger

    original = c10d_logger._get_msg_dict
    undo = hook_collective_errors(FailureDelivery())
    assert c10d_logger._get_msg_dict is not original
    assert c10d_logger._get_msg_dict("all_reduce") == original("all_reduce")  # not in an error path
    undo()
    assert c10d_logger._get_msg_dict is original


def test_a_failure_recorded_during_setup_is_raised_once_back_in_the_callers_code() -> None:
    """A child that fails while setup is still running cannot be raised inside multigpu's code; the end
    of setup raises it, and only once (finalize() reports it again on its own)."""
    from multigpu.contract.errors import WorkerFailedError
    from multigpu.contract.failure import WorkerFailure
    from multigpu.otx.interrupt_caller import FailureDelivery

    delivery = FailureDelivery()
    delivery.raise_pending()  # nothing recorded: nothing raised
    error = WorkerFailedError(WorkerFailure(rank=2, local_rank=2, pid=None, exit_code=1))
    assert delivery.deliver(error)
    with pytest.raises(WorkerFailedError) as caught:
        delivery.raise_pending()
    assert caught.value is error
    delivery.raise_pending()  # delivered: not again


class CountingStore:
    """A store whose counter other ranks bump as it is read: ``others`` more ranks per read."""

    def __init__(self, others: int = 0) -> None:
        self.count, self.others = 0, others

    def add(self, key: str, value: int) -> int:
        assert key == "multigpu/joined/run"
        self.count += value + (self.others if value == 0 else 0)
        return self.count


def test_every_rank_counted_in_ends_the_wait() -> None:
    from multigpu.otx.rank_setup import wait_for_every_rank

    store = CountingStore(others=1)
    wait_for_every_rank(store, "multigpu/joined/run", 3, timeout=5, failed=lambda: None)
    assert store.count == 3


def test_a_child_failure_ends_the_wait_with_that_error() -> None:
    from multigpu.otx.rank_setup import wait_for_every_rank

    boom = RuntimeError("rank 2 died")
    with pytest.raises(RuntimeError, match="rank 2 died"):
        wait_for_every_rank(CountingStore(), "multigpu/joined/run", 3, timeout=5, failed=lambda: boom)


def test_ranks_that_never_come_time_out() -> None:
    from multigpu.otx.rank_setup import wait_for_every_rank

    with pytest.raises(TimeoutError, match=r"only 1 of 3 ranks joined within 0\.05s"):
        wait_for_every_rank(CountingStore(), "multigpu/joined/run", 3, timeout=0.05, failed=lambda: None)
