"""torchrun's ``--numa-binding``: which CPUs each rank may run on, read from sysfs; applied in the worker.

The launcher decides (it knows every rank's GPU); the worker bootstrap applies the answer with
``os.sched_setaffinity`` before user code runs, so threads the script starts inherit it, and memory
is then allocated on that node by the kernel's first-touch policy. Without sysfs information (a
container, a GPU whose ``numa_node`` is -1) a rank is left unbound, as torch does. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from multigpu.contract.names import parse_cpulist

SYSFS = Path("/sys")
PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def gpu_numa_node(bus_id: str, sysfs: Path = SYSFS) -> int | None:
    try:
        node = int((sysfs / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: Path = SYSFS) -> list[int]:
    try:
        return parse_cpulist((sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist").read_text())
    except OSError:
        return []


def socket_nodes(node: int, sysfs: Path = SYSFS) -> list[int]:
    """Every NUMA node on the same socket (physical package) as ``node``."""

    def package(n: int) -> str | None:
        cpus = node_cpus(n, sysfs)
        path = sysfs / "devices" / "system" / "cpu" / f"cpu{cpus[0]}" / "topology" / "physical_package_id"
        try:
            return path.read_text().strip() if cpus else None
        except OSError:
            return None

    mine = package(node)
    root = sysfs / "devices" / "system" / "node"
    nodes = sorted(int(p.name[4:]) for p in root.glob("node[0-9]*")) if root.is_dir() else [node]
    return [n for n in nodes if n == node or (mine is not None and package(n) == mine)]


def share(cpus: Sequence[int], index: int, count: int) -> list[int]:
    """The ``index``-th of ``count`` equal, contiguous shares (the first ones get one more if uneven)."""
    ordered = sorted(cpus)
    size, extra = divmod(len(ordered), max(1, count))
    start = index * size + min(index, extra)
    return ordered[start : start + size + (1 if index < extra else 0)] or ordered[:1]


def gpu_bus_ids(root: Path = PROC_GPUS) -> list[str]:
    """PCI bus ids of the driver's GPUs, in driver order (the directory names under /proc)."""
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def gpu_rank_cpus(
    mode: str, bus_ids: Sequence[str], allowed: set[int], sysfs: Path = SYSFS
) -> list[list[int] | None]:
    """One CPU list per local rank, whose GPU has the PCI bus id ``bus_ids[local_rank]``."""
    nodes = [gpu_numa_node(b, sysfs) for b in bus_ids]
    answer: list[list[int] | None] = []
    for rank, node in enumerate(nodes):
        if node is None:
            answer.append(None)
            continue
        members = socket_nodes(node, sysfs) if mode == "socket" else [node]
        cpus = [c for n in members for c in node_cpus(n, sysfs) if c in allowed]
        if mode in ("exclusive", "core-complex"):
            peers = [r for r, n in enumerate(nodes) if n == node]
            cpus = share(cpus, peers.index(rank), len(peers))
        answer.append(cpus or None)
    return answer


def cpu_rank_cpus(nproc: int, allowed: set[int]) -> list[list[int] | None]:
    """CPU workers have no GPU to be near: each gets an equal share of the usable cores."""
    return [share(sorted(allowed), i, nproc) for i in range(nproc)]
