"""``--numa-binding``: CPU lists from a fake sysfs tree; no processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from multigpu.cluster import numa
from multigpu.contract.names import AFFINITY_ENV, format_cpulist, parse_cpulist
from multigpu.rank.bootstrap import apply_affinity


def fake_sysfs(root: Path, nodes: dict[int, str], packages: dict[int, int], gpus: dict[str, int]) -> Path:
    """nodes: node -> cpulist; packages: node -> socket; gpus: PCI bus id -> NUMA node."""
    for node, cpulist in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        for cpu in parse_cpulist(cpulist):
            topo = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text(f"{packages[node]}\n")
    for bus, node in gpus.items():
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    # two sockets, two NUMA nodes each; GPUs 0,1 on node 0, GPU 2 on node 3, GPU 3 with no NUMA info
    return fake_sysfs(
        tmp_path,
        {0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"},
        {0: 0, 1: 0, 2: 1, 3: 1},
        {"0000:1a:00.0": 0, "0000:1b:00.0": 0, "0000:8a:00.0": 3, "0000:8b:00.0": -1},
    )


BUSES = ["0000:1A:00.0", "0000:1b:00.0", "0000:8a:00.0", "0000:8b:00.0"]


def test_cpulist_round_trip() -> None:
    assert parse_cpulist("0-2,8,10-11\n") == [0, 1, 2, 8, 10, 11]
    assert format_cpulist([3, 1, 2]) == "1,2,3"


def test_node_mode_binds_each_rank_to_its_gpus_node(sysfs: Path) -> None:
    cpus = numa.gpu_rank_cpus("node", BUSES, set(range(16)), sysfs)
    assert cpus == [[0, 1, 2, 3], [0, 1, 2, 3], [12, 13, 14, 15], None]


def test_socket_mode_takes_every_node_of_the_socket(sysfs: Path) -> None:
    cpus = numa.gpu_rank_cpus("socket", BUSES[:3], set(range(16)), sysfs)
    assert cpus == [list(range(8)), list(range(8)), list(range(8, 16))]


def test_exclusive_mode_splits_a_node_between_its_gpus(sysfs: Path) -> None:
    cpus = numa.gpu_rank_cpus("exclusive", BUSES[:3], set(range(16)), sysfs)
    assert cpus == [[0, 1], [2, 3], [12, 13, 14, 15]]


def test_only_cpus_this_process_may_use(sysfs: Path) -> None:
    assert numa.gpu_rank_cpus("node", BUSES[:1], {2, 3, 9}, sysfs) == [[2, 3]]


def test_cpu_workers_get_equal_shares() -> None:
    assert numa.cpu_rank_cpus(3, set(range(8))) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert numa.cpu_rank_cpus(3, {5}) == [[5], [5], [5]]  # fewer cores than ranks: share the one


def test_worker_applies_the_launchers_choice() -> None:
    before = os.sched_getaffinity(0)
    target = {min(before)}
    try:
        apply_affinity({AFFINITY_ENV: format_cpulist(sorted(target))})
        assert os.sched_getaffinity(0) == target
        apply_affinity({})  # nothing chosen: nothing changes
        assert os.sched_getaffinity(0) == target
    finally:
        os.sched_setaffinity(0, before)
