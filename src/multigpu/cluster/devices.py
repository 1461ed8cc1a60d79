"""Which GPUs exist and which the user may use, found without torch and without a CUDA context.

NVML (``nvidia-ml-py``) is asked first, then the driver's ``/proc/driver/nvidia/gpus``. Indices the user
types are *visible* indices: positions in ``CUDA_VISIBLE_DEVICES`` when it is set, as in CUDA itself.
``choose_devices`` is the one answer to "which device, how many workers, which GPUs" for ``multigpu
run``, ``multigpu.launch`` and OTX's manager; each caller words its own errors. Runs in the launcher
(or the caller, in function mode).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, cast, get_args

from multigpu.contract.environment import Device

PROC_GPUS = Path("/proc/driver/nvidia/gpus")

Wish = Literal["auto", "cuda", "cpu"]
"""The device a caller asks for: ``auto`` is the GPUs when any is visible, else the CPU fallback."""
NotVisiblePolicy = Literal["refuse", "drop"]
"""What an asked-for GPU that is not visible does: refuse the whole request (``multigpu run``,
``multigpu.launch``), or drop that GPU and keep the rest (OTX's ``get_gpu_ids`` and manager)."""


@dataclass(frozen=True)
class GPUInfo:
    index: int
    """Visible index (what ``torch.cuda.device(i)`` would name)."""
    ordinal: str
    """What the driver calls it: a physical index, or the UUID/MIG name from CUDA_VISIBLE_DEVICES."""
    name: str
    uuid: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None


def _nvml_gpus() -> list[GPUInfo] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GPUInfo(
                    index=i,
                    ordinal=str(i),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    memory_total_mib=int(mem.total) // 2**20,
                    memory_used_mib=int(mem.used) // 2**20,
                )
            )
        return gpus
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _proc_gpus(root: Path = PROC_GPUS) -> list[GPUInfo]:
    if not root.is_dir():
        return []
    gpus = []
    for i, entry in enumerate(sorted(root.iterdir())):
        fields: dict[str, str] = {}
        try:
            for line in (entry / "information").read_text().splitlines():
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        except OSError:
            continue
        uuid = fields.get("GPU UUID")
        gpus.append(GPUInfo(index=i, ordinal=str(i), name=fields.get("Model", "NVIDIA GPU"), uuid=uuid))
    return gpus


def physical_gpus() -> list[GPUInfo]:
    """Every GPU the driver knows, in driver (PCI bus) order."""
    gpus = _nvml_gpus()
    return gpus if gpus is not None else _proc_gpus()


def apply_visible_devices(gpus: list[GPUInfo], cuda_visible_devices: str | None) -> list[GPUInfo]:
    """The GPUs a process sees under ``CUDA_VISIBLE_DEVICES``, renumbered from 0 like CUDA does.

    CUDA stops at the first entry it cannot match, so this does too.
    """
    if cuda_visible_devices is None:
        return gpus
    visible: list[GPUInfo] = []
    for raw in cuda_visible_devices.split(","):
        item = raw.strip()
        match = _match_visible_entry(gpus, item)
        if match is None or match in visible:
            break
        visible.append(match)
    return [
        replace(g, index=i, ordinal=_entry_ordinal(g, raw.strip()))
        for i, (g, raw) in enumerate(zip(visible, cuda_visible_devices.split(","), strict=False))
    ]


def _match_visible_entry(gpus: list[GPUInfo], item: str) -> GPUInfo | None:
    if item.isdigit():
        n = int(item)
        return next((g for g in gpus if g.ordinal == str(n)), None)
    if item.startswith(("GPU-", "MIG-")):
        for g in gpus:
            if g.uuid and (g.uuid.startswith(item) or item.startswith(g.uuid)):
                return g
        # Without UUIDs (no NVML) trust the user: CUDA will resolve it.
        if not any(g.uuid for g in gpus) and gpus:
            return GPUInfo(index=-1, ordinal=item, name="NVIDIA GPU")
    return None


def _entry_ordinal(gpu: GPUInfo, entry: str) -> str:
    return entry if entry.startswith(("GPU-", "MIG-")) else gpu.ordinal


def visible_gpus(
    env: Mapping[str, str] | None = None, discover: Callable[[], list[GPUInfo]] = physical_gpus
) -> list[GPUInfo]:
    env = os.environ if env is None else env
    return apply_visible_devices(discover(), env.get("CUDA_VISIBLE_DEVICES"))


def parse_index_list(text: str, *, what: str = "gpus") -> list[int]:
    """Comma-separated non-negative integers; spaces allowed. A bad item is a ValueError naming it."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string of comma-separated indices, got {text!r}")
    indices = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"{what} {text!r} has an empty item; write indices like '0,1'")
        if not item.lstrip("-").isdigit():
            raise ValueError(f"{what} item {item!r} is not an integer index")
        value = int(item)
        if value < 0:
            raise ValueError(f"{what} item {item!r} is negative; indices start at 0")
        indices.append(value)
    return indices


def dedupe(indices: list[int], *, what: str = "gpus") -> list[int]:
    seen: list[int] = []
    dupes = sorted({i for i in indices if indices.count(i) > 1})
    for i in indices:
        if i not in seen:
            seen.append(i)
    if dupes:
        warnings.warn(f"{what}: dropped duplicate indices {dupes}", stacklevel=3)
    return seen


@dataclass(frozen=True)
class Devices:
    """``choose_devices``'s answer: the workers' device, how many, and the GPU each uses."""

    device: Device
    count: int
    """Local workers."""
    gpus: tuple[int, ...] = ()
    """Visible GPU index of worker i (empty on the CPU)."""
    dropped: tuple[int, ...] = ()
    """Asked-for GPUs that are not visible, left out under the ``drop`` policy."""


class NotVisibleError(ValueError):
    """Asked-for GPUs are not visible (``missing``; with ``visible`` 0, none is). Callers reword it."""

    def __init__(self, missing: tuple[int, ...], visible: int) -> None:
        super().__init__(f"GPU indices {list(missing)} are not visible ({visible} visible)")
        self.missing, self.visible = missing, visible


def choose_devices(
    visible: int,
    *,
    device: Wish = "auto",
    gpus: Sequence[int] | None = None,
    count: int | None = None,
    cpu_fallback: int | None = None,
    missing: NotVisiblePolicy = "refuse",
) -> Devices:
    """The workers for ``visible`` GPUs (visible indices are ``0..visible-1``, as CUDA numbers them).

    Asked by ``gpus`` (those indices), by ``count`` (the first ``count`` GPUs: local rank i uses GPU i)
    or by neither (every visible GPU). ``device="cpu"`` is ``count`` CPU workers; ``"auto"`` with no GPU
    visible is ``cpu_fallback`` CPU workers when one is given. A GPU that is not visible, or no GPU at
    all, raises ``NotVisibleError`` under ``refuse`` and is left out under ``drop``. Pure: discovery
    (``visible_gpus``) is the caller's, so no CUDA context and tests that need no GPU.
    """
    if device == "cpu":
        return Devices("cpu", count if count is not None else len(gpus or ()))
    if device == "auto" and not visible and cpu_fallback is not None:
        return Devices("cpu", cpu_fallback)
    wanted = tuple(gpus) if gpus is not None else tuple(range(visible if count is None else count))
    absent = tuple(i for i in wanted if i >= visible)
    if missing == "refuse" and (absent or not visible):
        raise NotVisibleError(absent, visible)
    kept = tuple(i for i in wanted if i < visible)
    return Devices("cuda", len(kept), kept, absent)


def device_wish(device: str) -> Wish:
    """``device=`` of ``multigpu.launch`` and the manager, checked (a ValueError names a wrong one)."""
    if device in get_args(Wish):
        return cast(Wish, device)
    raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")


def keep_visible(requested: list[int], visible: int) -> list[int]:
    """OTX's policy: the requested GPUs that are visible, the others dropped with one warning (and ``[]``
    with a warning when no GPU is). The warning names the line that called ``get_gpu_ids`` or built
    the manager."""
    found = choose_devices(visible, device="cuda", gpus=requested, missing="drop")
    if not visible:
        warnings.warn("no GPU is visible; get_gpu_ids returns []", stacklevel=3)
    elif found.dropped:
        warnings.warn(
            f"GPU indices {list(found.dropped)} are not visible ({visible} visible); dropped them",
            stacklevel=3,
        )
    return list(found.gpus)


def get_gpu_ids(gpus: str) -> list[int]:
    """Visible GPU indices from a ``--gpus`` string: validated, deduplicated, order kept.

    Indices past the visible count are dropped with one warning; with no GPU at all the answer is ``[]``.
    Never creates a CUDA context, so workers can still be forked afterwards.
    """
    return keep_visible(dedupe(parse_index_list(gpus)), len(visible_gpus()))


def cuda_visible_devices_for(chosen: list[int], visible: list[GPUInfo]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows exactly ``chosen`` (visible indices), in order."""
    by_index = {g.index: g for g in visible}
    return ",".join(by_index[i].ordinal for i in chosen)
