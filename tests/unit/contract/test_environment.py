"""The worker environment: torchrun's contract from a pure function."""

from __future__ import annotations

import os
from types import MappingProxyType

import pytest

from multigpu import is_multigpu_child_process
from multigpu.contract.environment import (
    CONTRACT_KEYS,
    JobContext,
    RankPlacement,
    build_worker_env,
    inside_launched_worker,
    omp_threads,
)

JOB = JobContext(
    master_addr="127.0.0.1",
    master_port=29511,
    run_id="run-abc",
    device="cpu",
    restart_count=1,
    max_restarts=3,
    output_dir="/runs/abc",
    cpu_count=8,
    launcher_pid=4242,
)
PLACE = RankPlacement(
    rank=5, local_rank=1, world_size=8, local_world_size=4, group_rank=1, group_world_size=2
)


def test_full_contract() -> None:
    env = build_worker_env({"PATH": "/bin", "HOME": "/h"}, PLACE, JOB, error_file="/runs/e.json")
    expected = {
        "PATH": "/bin",
        "HOME": "/h",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "ROLE_RANK": "5",
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RUN_ID": "run-abc",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": "/runs/e.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "2",
        "PYTHONUNBUFFERED": "1",
        "MULTIGPU_RUN_ID": "run-abc",
        "MULTIGPU_OUTPUT_DIR": "/runs/abc",
        "MULTIGPU_DEVICE": "cpu",
        "MULTIGPU_NODE_RANK": "1",
        "MULTIGPU_ATTEMPT": "1",
        "MULTIGPU_LAUNCHER_PID": "4242",
        "MULTIGPU_ERROR_FILE": "/runs/e.json",
    }
    assert env == expected
    assert all(isinstance(v, str) for v in env.values())


def test_optional_keys_absent_when_not_given() -> None:
    job = JobContext(master_addr="10.0.0.1", master_port=1, run_id="r", use_agent_store=False)
    env = build_worker_env({}, RankPlacement(0, 0, 1, 1), job)
    for key in (
        "TORCHELASTIC_USE_AGENT_STORE",
        "MULTIGPU_OUTPUT_DIR",
        "MULTIGPU_LAUNCHER_PID",
        "MULTIGPU_ERROR_FILE",
        "TORCHELASTIC_ERROR_FILE",
        "CUDA_VISIBLE_DEVICES",
    ):
        assert key not in env
    assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"


def test_cuda_visible_devices_set_for_gpu_jobs() -> None:
    job = JobContext(
        master_addr="127.0.0.1", master_port=1, run_id="r", device="cuda", cuda_visible_devices="5,2"
    )
    env = build_worker_env({"CUDA_VISIBLE_DEVICES": "2,3,5"}, RankPlacement(0, 0, 2, 2), job)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,2"
    assert env["MULTIGPU_DEVICE"] == "cuda"


@pytest.mark.parametrize(
    ("cores", "local", "threads"),
    [
        (8, 4, 2),
        (8, 3, 2),
        (2, 3, 1),
        (1, 8, 1),
        (None, 2, 1),
        (16, 1, 16),
        (2, 0, 2),
    ],
)
def test_omp_threads(cores: int | None, local: int, threads: int) -> None:
    assert omp_threads(cores, local) == threads


def test_omp_num_threads_from_cores_per_local_worker() -> None:
    job = JobContext(master_addr="127.0.0.1", master_port=1, run_id="r", cpu_count=2)
    assert build_worker_env({}, RankPlacement(0, 0, 3, 3), job)["OMP_NUM_THREADS"] == "1"
    job = JobContext(master_addr="127.0.0.1", master_port=1, run_id="r", cpu_count=12)
    assert build_worker_env({}, RankPlacement(0, 0, 3, 3), job)["OMP_NUM_THREADS"] == "4"


def test_user_settings_are_kept() -> None:
    base = {"OMP_NUM_THREADS": "7", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = build_worker_env(base, PLACE, JOB)
    assert env["OMP_NUM_THREADS"] == "7"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_stale_contract_keys_from_the_base_are_removed() -> None:
    stale = {key: "stale" for key in CONTRACT_KEYS}
    job = JobContext(master_addr="127.0.0.1", master_port=1, run_id="r", use_agent_store=False)
    env = build_worker_env({**stale, "KEEP": "me"}, RankPlacement(0, 0, 1, 1), job)
    assert "stale" not in env.values()
    assert env["KEEP"] == "me"
    for key in (
        "MULTIGPU_HEARTBEAT_FD",
        "TORCHELASTIC_ERROR_FILE",
        "MULTIGPU_OUTPUT_DIR",
        "TORCHELASTIC_USE_AGENT_STORE",
        "MULTIGPU_LAUNCHER_PID",
    ):
        assert key not in env


def test_input_mapping_and_os_environ_are_not_mutated() -> None:
    base = {"RANK": "9", "PATH": "/bin"}
    before_os = dict(os.environ)
    env = build_worker_env(base, PLACE, JOB)
    assert base == {"RANK": "9", "PATH": "/bin"}
    assert dict(os.environ) == before_os
    env["PATH"] = "changed"
    assert base["PATH"] == "/bin"
    # a read-only mapping works too
    assert build_worker_env(MappingProxyType({"A": "1"}), PLACE, JOB)["A"] == "1"


@pytest.mark.parametrize(
    ("env", "child"),
    [
        ({}, False),
        ({"LOCAL_RANK": "0"}, False),
        ({"LOCAL_RANK": "1"}, True),
        ({"LOCAL_RANK": "7"}, True),
        ({"LOCAL_RANK": " 2 "}, True),
        ({"LOCAL_RANK": ""}, False),
        ({"LOCAL_RANK": "abc"}, False),
        ({"LOCAL_RANK": "1.5"}, False),
        ({"LOCAL_RANK": "\x00"}, False),
        ({"RANK": "3"}, False),
    ],
)
def test_is_multigpu_child_process_never_raises(env: dict[str, str], child: bool) -> None:
    assert is_multigpu_child_process(env) is child


def test_is_multigpu_child_process_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "garbage")
    assert is_multigpu_child_process() is False
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert is_multigpu_child_process() is True
    monkeypatch.delenv("LOCAL_RANK")
    assert is_multigpu_child_process() is False


@pytest.mark.parametrize(
    ("env", "inside"),
    [
        ({}, False),
        ({"TORCHELASTIC_RUN_ID": "x"}, True),
        ({"MULTIGPU_LAUNCHER_PID": "12"}, True),
        # MULTIGPU_RUN_ID alone is how a user sets --run-id for the launcher: not a worker marker
        ({"MULTIGPU_RUN_ID": "mine"}, False),
    ],
)
def test_inside_launched_worker(env: dict[str, str], inside: bool) -> None:
    assert inside_launched_worker(env) is inside


def test_every_worker_env_is_recognised_as_inside() -> None:
    assert inside_launched_worker(build_worker_env({}, PLACE, JOB))
