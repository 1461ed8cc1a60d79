"""Who sent a SIGKILL (``supervisor/oom.py``), from a cgroup and a kernel log written here by the test."""

from __future__ import annotations

import os
from pathlib import Path

from multigpu.contract.failure import WorkerFailure
from multigpu.runner.crash_loop import CrashLoopPolicy
from multigpu.supervisor.oom import MemoryCgroup, OomWatch, kernel_kill_rss, size

KMSG = (
    "6,1,1,-;Out of memory: Killed process 4242 (python) total-vm:2000000kB, anon-rss:589500kB, "
    "file-rss:0kB, shmem-rss:12kB, UID:0 pgtables:1200kB oom_score_adj:0\n"
)


def test_the_kernels_line_gives_the_killed_process_resident_memory(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(KMSG)
    assert kernel_kill_rss(4242, str(log)) == (589500 + 12) * 1024
    assert kernel_kill_rss(4243, str(log)) is None
    assert kernel_kill_rss(4242, str(tmp_path / "missing")) is None


def test_a_v1_cgroup_counts_oom_kills_and_states_its_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (tmp_path / "memory.limit_in_bytes").write_text(str(600 << 20))
    cgroup = MemoryCgroup(tmp_path, 1)
    assert cgroup.oom_kills() == 3 and cgroup.limit() == 600 << 20
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert cgroup.limit() is None  # v1's "no limit"


def test_a_v2_cgroup_reads_memory_events_and_max(tmp_path: Path) -> None:
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    (tmp_path / "memory.max").write_text("max\n")
    cgroup = MemoryCgroup(tmp_path, 2)
    assert cgroup.oom_kills() == 1 and cgroup.limit() is None


def test_a_counter_that_moved_names_the_oom_killer_even_without_the_log(tmp_path: Path) -> None:
    (tmp_path / "memory.oom_control").write_text("oom_kill 0\n")
    (tmp_path / "memory.limit_in_bytes").write_text(str(24 << 30))
    watch = OomWatch(MemoryCgroup(tmp_path, 1), 0)
    assert watch.explain(os.getpid()) is None  # nothing moved: some other SIGKILL
    (tmp_path / "memory.oom_control").write_text("oom_kill 1\n")
    assert watch.explain(os.getpid()) == "the kernel's OOM killer (a 24.0 GiB limit)"


def test_sizes_read_as_people_write_them() -> None:
    assert (size(21 << 30), size(600 << 20), size(2048)) == ("21.0 GiB", "600.0 MiB", "2 KiB")


def test_an_oom_kill_on_two_attempts_in_a_row_is_a_crash_loop_whichever_rank() -> None:
    policy = CrashLoopPolicy()
    oom = "the kernel's OOM killer (resident 575.7 MiB of a 600.0 MiB limit)"
    first = WorkerFailure(rank=1, local_rank=1, pid=10, signal="SIGKILL", killed_by=oom)
    second = WorkerFailure(rank=3, local_rank=3, pid=11, signal="SIGKILL", killed_by=oom)
    assert policy.check(first) is None
    verdict = policy.check(second)
    assert verdict is not None and "SIGKILL from the kernel's OOM killer" in verdict
    plain = WorkerFailure(rank=1, local_rank=1, pid=12, signal="SIGKILL")
    assert CrashLoopPolicy().check(plain) is None and "killed by SIGKILL" in plain.describe()
