"""Device discovery and ``--gpus`` parsing: no torch, no CUDA, discovery monkeypatched."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from multigpu.cluster import devices
from multigpu.cluster.devices import (
    Devices,
    GPUInfo,
    NotVisibleError,
    apply_visible_devices,
    choose_devices,
    cuda_visible_devices_for,
    dedupe,
    device_wish,
    get_gpu_ids,
    keep_visible,
    parse_index_list,
    visible_gpus,
)


def fake_gpus(n: int, *, uuids: bool = True) -> list[GPUInfo]:
    return [
        GPUInfo(index=i, ordinal=str(i), name=f"Fake {i}", uuid=f"GPU-{i:08x}-aaaa" if uuids else None)
        for i in range(n)
    ]


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four GPUs through the NVML path, no CUDA_VISIBLE_DEVICES."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: fake_gpus(4))


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: None)
    monkeypatch.setattr(devices, "_proc_gpus", lambda root=devices.PROC_GPUS: [])


# ---- parse_index_list / dedupe ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", [0]),
        ("0,1", [0, 1]),
        (" 2 , 0 ,1 ", [2, 0, 1]),
        ("10,3", [10, 3]),
        ("1,1", [1, 1]),
    ],
)
def test_parse_index_list_accepts(text: str, expected: list[int]) -> None:
    assert parse_index_list(text) == expected


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("a", "'a'"),
        ("0,a", "'a'"),
        ("-1", "'-1'"),
        ("0,-2", "'-2'"),
        ("0,,1", "'0,,1'"),
        ("", "empty"),
        ("1.5", "'1.5'"),
        ("0,", "empty"),
    ],
)
def test_parse_index_list_rejects_naming_the_item(text: str, named: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_index_list(text)
    assert named in str(info.value)


def test_parse_index_list_rejects_non_string() -> None:
    with pytest.raises(ValueError, match="string"):
        parse_index_list(3)  # type: ignore[arg-type]


def test_dedupe_keeps_order_and_warns_once() -> None:
    with pytest.warns(UserWarning) as record:
        assert dedupe([2, 0, 2, 1, 0]) == [2, 0, 1]
    assert len(record) == 1
    assert "[0, 2]" in str(record[0].message)


def test_dedupe_without_duplicates_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dedupe([3, 1]) == [3, 1]


# ---- get_gpu_ids ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("gpus")
def test_get_gpu_ids_valid_is_silent_and_ordered() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_gpu_ids("3, 0,2") == [3, 0, 2]


@pytest.mark.usefixtures("gpus")
def test_get_gpu_ids_drops_out_of_range_with_one_warning_naming_them() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert get_gpu_ids("1,7,0,9") == [1, 0]
    assert len(record) == 1
    message = str(record[0].message)
    assert "7" in message and "9" in message


@pytest.mark.usefixtures("gpus")
def test_get_gpu_ids_drops_duplicates_with_a_warning() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert get_gpu_ids("2,1,2") == [2, 1]
    assert len(record) == 1
    assert "duplicate" in str(record[0].message)


@pytest.mark.usefixtures("no_gpu")
def test_get_gpu_ids_without_gpu_returns_empty_with_warning() -> None:
    with pytest.warns(UserWarning, match="no GPU"):
        assert get_gpu_ids("0,1") == []


@pytest.mark.usefixtures("gpus")
@pytest.mark.parametrize(("text", "named"), [("a", "'a'"), ("-1", "'-1'"), ("0,,1", "'0,,1'")])
def test_get_gpu_ids_rejects_bad_items(text: str, named: str) -> None:
    with pytest.raises(ValueError) as info:
        get_gpu_ids(text)
    assert named in str(info.value)


@pytest.mark.usefixtures("gpus")
def test_get_gpu_ids_counts_only_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.warns(UserWarning, match=r"\[2\]"):
        assert get_gpu_ids("1,2,0") == [1, 0]


@pytest.mark.integration
def test_get_gpu_ids_imports_no_torch() -> None:
    code = (
        "import sys, warnings; warnings.simplefilter('ignore'); import multigpu; "
        "multigpu.get_gpu_ids('0,1'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- choose_devices: pure, the visible count given -----------------------------------------------------


def test_choose_devices_takes_every_visible_gpu_by_default() -> None:
    assert choose_devices(4) == Devices("cuda", 4, (0, 1, 2, 3))


def test_choose_devices_takes_the_listed_gpus_in_their_order() -> None:
    assert choose_devices(4, gpus=[2, 0]) == Devices("cuda", 2, (2, 0))


def test_choose_devices_by_count_gives_local_rank_i_gpu_i() -> None:
    assert choose_devices(4, count=3) == Devices("cuda", 3, (0, 1, 2))
    assert choose_devices(2, device="cuda", count=2) == Devices("cuda", 2, (0, 1))


def test_choose_devices_on_the_cpu_discovers_nothing_and_counts_workers() -> None:
    assert choose_devices(4, device="cpu", count=3) == Devices("cpu", 3)
    assert choose_devices(0, device="cpu", gpus=[0, 1]) == Devices("cpu", 2)


def test_choose_devices_falls_back_to_the_cpu_only_for_auto_without_a_gpu() -> None:
    assert choose_devices(0, cpu_fallback=1) == Devices("cpu", 1)
    assert choose_devices(0, count=3, cpu_fallback=3) == Devices("cpu", 3)
    assert choose_devices(2, cpu_fallback=1) == Devices("cuda", 2, (0, 1))  # GPUs visible: no fallback
    with pytest.raises(NotVisibleError):
        choose_devices(0, device="cuda", count=2, cpu_fallback=2)


def test_a_gpu_that_is_not_visible_is_refused_naming_it() -> None:
    with pytest.raises(NotVisibleError) as info:
        choose_devices(2, gpus=[0, 5, 7])
    assert (info.value.missing, info.value.visible) == ((5, 7), 2)
    assert str(info.value) == "GPU indices [5, 7] are not visible (2 visible)"
    with pytest.raises(NotVisibleError) as by_count:
        choose_devices(2, count=3)
    assert by_count.value.missing == (2,)


def test_no_visible_gpu_is_refused_even_when_none_is_named() -> None:
    with pytest.raises(NotVisibleError) as info:
        choose_devices(0)
    assert (info.value.missing, info.value.visible) == ((), 0)


def test_a_gpu_that_is_not_visible_is_dropped_under_the_drop_policy() -> None:
    assert choose_devices(2, gpus=[1, 5, 0], missing="drop") == Devices("cuda", 2, (1, 0), dropped=(5,))
    assert choose_devices(0, gpus=[0, 1], missing="drop") == Devices("cuda", 0, (), dropped=(0, 1))


def test_keep_visible_is_otx_policy_warn_and_drop() -> None:
    with pytest.warns(UserWarning, match=r"GPU indices \[5\] are not visible \(2 visible\); dropped them"):
        assert keep_visible([1, 5], 2) == [1]
    with pytest.warns(UserWarning, match=r"no GPU is visible; get_gpu_ids returns \[\]"):
        assert keep_visible([0], 0) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert keep_visible([1, 0], 2) == [1, 0]


def test_device_wish_names_a_wrong_device() -> None:
    assert [device_wish(d) for d in ("auto", "cuda", "cpu")] == ["auto", "cuda", "cpu"]
    with pytest.raises(ValueError, match="device must be 'auto', 'cuda' or 'cpu', got 'tpu'"):
        device_wish("tpu")


# ---- CUDA_VISIBLE_DEVICES mapping ------------------------------------------------------------------------


def test_apply_visible_devices_none_is_identity() -> None:
    gpus = fake_gpus(3)
    assert apply_visible_devices(gpus, None) == gpus


def test_apply_visible_devices_renumbers_through_user_value() -> None:
    visible = apply_visible_devices(fake_gpus(6), "2,3,5")
    assert [g.index for g in visible] == [0, 1, 2]
    assert [g.ordinal for g in visible] == ["2", "3", "5"]
    assert [g.name for g in visible] == ["Fake 2", "Fake 3", "Fake 5"]


def test_apply_visible_devices_stops_at_first_unknown_entry() -> None:
    assert [g.ordinal for g in apply_visible_devices(fake_gpus(4), "1,9,2")] == ["1"]
    assert apply_visible_devices(fake_gpus(4), "") == []
    assert apply_visible_devices(fake_gpus(4), "-1") == []
    assert [g.ordinal for g in apply_visible_devices(fake_gpus(4), "0,0,1")] == ["0"]


def test_apply_visible_devices_matches_uuid_prefixes() -> None:
    gpus = fake_gpus(4)
    visible = apply_visible_devices(gpus, f"{gpus[3].uuid}, GPU-00000001")
    assert [g.name for g in visible] == ["Fake 3", "Fake 1"]
    assert [g.ordinal for g in visible] == [gpus[3].uuid, "GPU-00000001"]
    assert [g.index for g in visible] == [0, 1]


def test_apply_visible_devices_trusts_uuids_without_nvml() -> None:
    visible = apply_visible_devices(fake_gpus(2, uuids=False), "MIG-abc,GPU-def")
    assert [g.ordinal for g in visible] == ["MIG-abc", "GPU-def"]
    assert [g.index for g in visible] == [0, 1]


def test_cuda_visible_devices_for_maps_through_user_value() -> None:
    visible = apply_visible_devices(fake_gpus(6), "2,3,5")
    assert cuda_visible_devices_for([2, 0], visible) == "5,2"
    assert cuda_visible_devices_for([0, 1, 2], visible) == "2,3,5"


def test_cuda_visible_devices_for_keeps_uuid_entries() -> None:
    gpus = fake_gpus(3)
    visible = apply_visible_devices(gpus, f"{gpus[2].uuid},1")
    assert cuda_visible_devices_for([1, 0], visible) == f"1,{gpus[2].uuid}"


def test_cuda_visible_devices_for_without_user_value() -> None:
    assert cuda_visible_devices_for([3, 1], fake_gpus(4)) == "3,1"


def test_visible_gpus_reads_the_given_environment() -> None:
    visible = visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, discover=lambda: fake_gpus(2))
    assert [(g.index, g.ordinal) for g in visible] == [(0, "1")]
    assert len(visible_gpus({}, discover=lambda: fake_gpus(2))) == 2


# ---- /proc/driver/nvidia/gpus -------------------------------------------------------------------------


def _proc_entry(root: Path, bus: str, model: str, uuid: str) -> None:
    entry = root / bus
    entry.mkdir(parents=True)
    (entry / "information").write_text(
        f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nVideo BIOS: \t ??.??.??\n"
        "Bus Location: \t " + bus + "\n"
    )


def test_proc_gpus_parses_driver_tree_in_bus_order(tmp_path: Path) -> None:
    _proc_entry(tmp_path, "0000:c1:00.0", "NVIDIA H100 80GB HBM3", "GPU-cccc")
    _proc_entry(tmp_path, "0000:41:00.0", "NVIDIA A100-SXM4-40GB", "GPU-aaaa")
    (tmp_path / "0000:81:00.0").mkdir()  # no information file: skipped
    gpus = devices._proc_gpus(tmp_path)
    assert [(g.name, g.uuid) for g in gpus] == [
        ("NVIDIA A100-SXM4-40GB", "GPU-aaaa"),
        ("NVIDIA H100 80GB HBM3", "GPU-cccc"),
    ]
    assert gpus[0].memory_total_mib is None


def test_proc_gpus_missing_tree_is_empty(tmp_path: Path) -> None:
    assert devices._proc_gpus(tmp_path / "nope") == []


def test_physical_gpus_falls_back_to_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _proc_entry(tmp_path, "0000:01:00.0", "NVIDIA T4", "GPU-1234")
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: None)
    monkeypatch.setattr(devices, "_proc_gpus", functools.partial(devices._proc_gpus, tmp_path))
    gpus = devices.physical_gpus()
    assert [(g.index, g.ordinal, g.name, g.uuid) for g in gpus] == [(0, "0", "NVIDIA T4", "GPU-1234")]


def test_physical_gpus_prefers_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: fake_gpus(1))
    monkeypatch.setattr(devices, "_proc_gpus", lambda: pytest.fail("NVML answered; /proc must not be read"))
    assert [g.name for g in devices.physical_gpus()] == ["Fake 0"]
