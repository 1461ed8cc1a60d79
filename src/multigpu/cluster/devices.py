"""Which GPUs exist and which the user may use, found without torch and without a CUDA context.

NVML (``nvidia-ml-py``) is asked first, then the driver's ``/proc/driver/nvidia/gpus``. Indices the user
types are *visible* indices: positions in ``CUDA_VISIBLE_DEVICES`` when it is set, as in CUDA itself.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


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


def get_gpu_ids(gpus: str) -> list[int]:
    """Visible GPU indices from a ``--gpus`` string: validated, deduplicated, order kept.

    Indices past the visible count are dropped with one warning; with no GPU at all the answer is ``[]``.
    Never creates a CUDA context, so workers can still be forked afterwards.
    """
    requested = dedupe(parse_index_list(gpus))
    count = len(visible_gpus())
    if count == 0:
        warnings.warn("no GPU is visible; get_gpu_ids returns []", stacklevel=2)
        return []
    missing = [i for i in requested if i >= count]
    if missing:
        warnings.warn(f"GPU indices {missing} are not visible ({count} visible); dropped them", stacklevel=2)
    return [i for i in requested if i < count]


def cuda_visible_devices_for(chosen: list[int], visible: list[GPUInfo]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows exactly ``chosen`` (visible indices), in order."""
    by_index = {g.index: g for g in visible}
    return ",".join(by_index[i].ordinal for i in chosen)
