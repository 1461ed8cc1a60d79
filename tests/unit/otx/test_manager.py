"""MultiGPUManager's constructor only validates; is_available and the peer timeout. No processes."""

from __future__ import annotations

import signal
import sys
from datetime import datetime, timedelta, timezone

import pytest

from multigpu import MultiGPUManager
from multigpu.cluster import devices
from multigpu.otx.manager import TIMEOUT_ENV, dist_timeout_s
from multigpu.rendezvous.store import DEFAULT_TIMEOUT_S


def train() -> None:
    raise AssertionError("the constructor must never call train_func")


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: None)
    monkeypatch.setattr(devices, "_proc_gpus", lambda root=devices.PROC_GPUS: [])
    for key in ("MULTIGPU_RUN_ID", "TORCHELASTIC_RUN_ID", "MULTIGPU_LAUNCHER_PID", TIMEOUT_ENV):
        monkeypatch.delenv(key, raising=False)


def test_constructor_has_no_side_effects(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["train.py", "--gpus", "0,1", "params", "--lr", "1"]
    monkeypatch.setattr(sys, "argv", list(argv))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    manager = MultiGPUManager(train, "0,1,2", device="cpu")
    assert sys.argv == argv
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert manager.is_available()
    manager.finalize()  # nothing was started: a no-op, twice
    manager.finalize()
    # the hygiene fixture checks that no process, thread, descriptor or variable appeared


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rdzv_endpoint": "localhost"}, "no port"),
        ({"rdzv_endpoint": "host:abc"}, "port must be a number"),
        ({"rdzv_endpoint": "::1:29500"}, "brackets"),
        ({"rdzv_endpoint": "10.0.0.1:0"}, "port 0 is only allowed on a loopback host"),
        ({"rdzv_endpoint": "node1:0"}, "port 0 is only allowed on a loopback host"),
        ({"base_rank": 2, "world_size": 3}, "base_rank 2 + 2 local worker(s) exceeds world_size 3"),
        ({"base_rank": 1}, "exceeds world_size 2"),
        ({"base_rank": -1}, "base_rank must be an integer >= 0"),
        ({"world_size": -2}, "world_size must be an integer >= 0"),
        ({"world_size": 1}, "exceeds world_size 1"),
        ({"world_size": 4}, "fixed rdzv_endpoint port"),
        ({"device": "tpu"}, "device must be 'auto', 'cuda' or 'cpu'"),
    ],
)
def test_constructor_rejects_with_a_message(kwargs: dict[str, object], message: str) -> None:
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError) as info:
        MultiGPUManager(train, "0,1", **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


@pytest.mark.parametrize(("ids", "named"), [("a", "'a'"), ("0,-1", "'-1'"), ("0,,1", "'0,,1'")])
def test_constructor_rejects_bad_ids(ids: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        MultiGPUManager(train, ids, device="cpu")


def test_train_func_must_be_callable() -> None:
    with pytest.raises(ValueError, match="callable"):
        MultiGPUManager("train", "0,1", device="cpu")  # type: ignore[arg-type]


def test_ipv6_loopback_port_zero_and_fixed_ports_are_fine() -> None:
    """Accepted, and kept as written: the endpoint and the world the ranks will join."""
    v6 = MultiGPUManager(train, "0,1", rdzv_endpoint="[::1]:0", device="cpu")
    assert (v6._endpoint.host, v6._endpoint.port, str(v6._endpoint)) == ("::1", 0, "[::1]:0")
    assert v6._world_size == 2
    fixed = MultiGPUManager(train, "0,1", rdzv_endpoint="10.0.0.1:29500", device="cpu")
    assert (str(fixed._endpoint), fixed._base_rank, fixed._world_size) == ("10.0.0.1:29500", 0, 2)
    second = MultiGPUManager(
        train, "0,1", rdzv_endpoint="10.0.0.1:29500", base_rank=2, world_size=4, device="cpu"
    )
    assert (second._base_rank, second._world_size, second._gpu_ids) == (2, 4, [0, 1])
    assert all(m._state == "new" for m in (v6, fixed, second))


def test_world_size_zero_means_the_local_count() -> None:
    manager = MultiGPUManager(train, "0,1,2", world_size=0, device="cpu")
    assert manager._world_size == 3


def test_duplicate_ids_dropped_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="duplicate"):
        manager = MultiGPUManager(train, "0,1,1", device="cpu")
    assert manager._gpu_ids == [0, 1]


def test_is_available() -> None:
    assert MultiGPUManager(train, "0,1", device="cpu").is_available()
    assert not MultiGPUManager(train, "0", device="cpu").is_available()


@pytest.mark.parametrize("marker", ["TORCHELASTIC_RUN_ID", "MULTIGPU_LAUNCHER_PID"])
def test_is_available_false_inside_a_launched_worker(monkeypatch: pytest.MonkeyPatch, marker: str) -> None:
    manager = MultiGPUManager(train, "0,1", device="cpu")
    monkeypatch.setenv(marker, "1")
    assert not manager.is_available()


def test_without_a_gpu_only_cpu_workers_are_available() -> None:
    """The seed's meaning: "multi-GPU training is available". With no GPU, OTX trains in one process."""
    with pytest.warns(UserWarning, match="no GPU"):
        auto = MultiGPUManager(train, "0,1")
    assert not auto.is_available()
    with pytest.warns(UserWarning, match="no GPU"):
        cuda = MultiGPUManager(train, "0,1", device="cuda")
    assert not cuda.is_available()
    assert MultiGPUManager(train, "0,1", device="cpu").is_available()


def test_auto_device_with_gpus_uses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [devices.GPUInfo(index=i, ordinal=str(i), name="GPU") for i in range(2)]
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.warns(UserWarning, match="not visible"):
        manager = MultiGPUManager(train, "0,1,5")  # 5 is not visible: dropped with a warning
    assert manager.is_available() and manager._gpu_ids == [0, 1] and manager._device == "cuda"


def test_gpu_ids_read_once_a_warning_each_for_duplicates_and_hidden_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = [devices.GPUInfo(index=i, ordinal=str(i), name="GPU") for i in range(2)]
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.warns(UserWarning) as record:
        manager = MultiGPUManager(train, "1,1,7,0")
    assert [str(w.message) for w in record] == [
        "gpu_ids: dropped duplicate indices [1]",
        "GPU indices [7] are not visible (2 visible); dropped them",
    ]
    assert manager._gpu_ids == [1, 0] and manager._world_size == 2  # the dropped GPU is no rank


# ---- dist_timeout_s -----------------------------------------------------------------------------------

NOW = datetime(2024, 5, 1, 12, 0, 0)


def test_timeout_default_without_start_time() -> None:
    assert dist_timeout_s(None, env={}) == DEFAULT_TIMEOUT_S


def test_timeout_never_below_default() -> None:
    assert dist_timeout_s(NOW - timedelta(seconds=10), env={}, now=NOW) == DEFAULT_TIMEOUT_S


def test_timeout_is_one_and_a_half_times_elapsed() -> None:
    start = NOW - timedelta(hours=2)
    assert dist_timeout_s(start, env={}, now=NOW) == pytest.approx(1.5 * 7200)


def test_timeout_with_aware_start_time() -> None:
    start = datetime.now(timezone.utc) - timedelta(hours=1)
    assert dist_timeout_s(start, env={}) == pytest.approx(5400, abs=5)


def test_explicit_timeout_wins() -> None:
    start = NOW - timedelta(hours=2)
    assert dist_timeout_s(start, explicit=60.0, env={TIMEOUT_ENV: "99"}, now=NOW) == 60.0


def test_environment_timeout_wins_over_elapsed() -> None:
    start = NOW - timedelta(hours=2)
    assert dist_timeout_s(start, env={TIMEOUT_ENV: "99"}, now=NOW) == 99.0


def test_environment_timeout_read_from_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "42")
    assert dist_timeout_s(NOW - timedelta(hours=5), now=NOW) == 42.0
