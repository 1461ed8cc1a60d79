"""``multigpu run`` end to end: real launchers, real CPU workers, bounded in time, checked by PID."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from helpers import MULTIGPU, assert_gone, clean_env, finish_all, pids_in, run_cli, start_cli, write_script
from multigpu.cluster.devices import visible_gpus

pytestmark = pytest.mark.integration

CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "MULTIGPU_RUN_ID",
    "MULTIGPU_OUTPUT_DIR",
)

ENV_DUMP = """
    import json, os, sys
    print(f"pid={os.getpid()}", flush=True)
    rank = os.environ["RANK"]
    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    keys = CONTRACT_KEYS
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"env_{rank}.json"), "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv, "pid": os.getpid()}, f)
""".replace("CONTRACT_KEYS", repr(CONTRACT))

ALL_REDUCE = """
    import os
    import torch
    import torch.distributed as dist
    print(f"pid={os.getpid()}", flush=True)
    dist.init_process_group()  # env:// and the default backend, exactly as under torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert t.item() == expected, (t.item(), expected)
    print(f"allreduce rank={rank} world={world} backend={dist.get_backend()} sum={t.item():g} "
          f"port={os.environ['MASTER_PORT']}", flush=True)
    dist.destroy_process_group()
"""


def _env_dumps(directory: Path, ranks: int) -> dict[int, dict[str, Any]]:
    return {r: json.loads((directory / f"env_{r}.json").read_text()) for r in range(ranks)}


def test_environment_contract_logs_and_record(tmp_path: Path) -> None:
    script = write_script(tmp_path, "dump.py", ENV_DUMP)
    out = tmp_path / "out"
    passed = ["--cpu", "5", "--gpus=1", "-m", "x", "--output", "y", "--", "--log-ranks", "a b", ""]
    result = run_cli(
        ["run", "--cpu", "3", "--output", str(out), "--run-id", "contract-run", str(script), *passed],
        cwd=tmp_path,
        timeout=45,
    )
    assert result.returncode == 0, result.stderr
    pids = pids_in(result.stdout)
    assert len(pids) == 3
    assert_gone(pids)

    dumps = _env_dumps(tmp_path, 3)
    ports = {d["env"]["MASTER_PORT"] for d in dumps.values()}
    assert len(ports) == 1
    port = ports.pop()
    assert port.isdigit() and int(port) > 0
    threads = str(max(1, len(os.sched_getaffinity(0)) // 3))
    for rank, dump in dumps.items():
        assert dump["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "TORCHELASTIC_RUN_ID": "contract-run",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1",
            "MULTIGPU_RUN_ID": "contract-run",
            "MULTIGPU_OUTPUT_DIR": str(out.resolve()),
        }, rank
        # everything after the script reaches it untouched, including words that look like our options
        assert dump["argv"] == [str(script), *passed]

    # per-rank log files with that rank's stdout and stderr
    for rank in range(3):
        log = (out / "logs" / "attempt_0" / f"rank_{rank}.log").read_text()
        assert f"stdout of rank {rank}" in log and f"stderr of rank {rank}" in log
        assert f"pid={dumps[rank]['pid']}" in log
        other = {f"of rank {r}" for r in range(3) if r != rank}
        assert not any(o in log for o in other)

    # the console: stdout lines on stdout, stderr lines on stderr, each with its rank
    for rank in range(3):
        assert f"[rank {rank}] stdout of rank {rank}\n" in result.stdout
        assert f"[rank {rank}] stderr of rank {rank}\n" in result.stderr
    assert str(out.resolve()) in result.stderr  # the output directory is printed at start

    record = json.loads((out / "run.json").read_text())
    assert record["run_id"] == "contract-run"
    assert record["command"][1:] == [
        "run",
        "--cpu",
        "3",
        "--output",
        str(out),
        "--run-id",
        "contract-run",
        str(script),
        *passed,
    ]
    assert record["config"]["nproc"] == 3 and record["config"]["device"] == "cpu"
    assert record["config"]["target"] == str(script) and record["config"]["target_args"] == passed
    assert record["devices"] == ["cpu"] * 3
    assert record["status"] == "succeeded" and record["exit_code"] == 0
    assert record["start_time"] <= record["end_time"]
    (attempt,) = record["attempts"]
    assert attempt["master_port"] == int(port)
    assert sorted(attempt["ranks"]) == ["0", "1", "2"]
    for rank in range(3):
        info = attempt["ranks"][str(rank)]
        assert info["pid"] == dumps[rank]["pid"]
        assert info["device"] == "cpu" and info["state"] == "succeeded"
        assert info["exit_code"] == 0 and info["signal"] is None
        assert record["start_time"] <= info["start_time"] <= info["end_time"] <= record["end_time"]
    assert not list(out.glob(".*tmp"))  # written atomically: no temporary file left behind


def test_plain_env_init_process_group(tmp_path: Path) -> None:
    script = write_script(tmp_path, "allreduce.py", ALL_REDUCE)
    result = run_cli(
        ["run", "--cpu", "2", "--output", str(tmp_path / "out"), str(script)], cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert_gone(pids_in(result.stdout))
    for rank in range(2):
        assert re.search(
            rf"^\[rank {rank}\] allreduce rank={rank} world=2 backend=\S+ sum=3 ", result.stdout, re.M
        ), result.stdout


def test_two_runs_started_at_once_get_different_ports(tmp_path: Path) -> None:
    script = write_script(tmp_path, "allreduce.py", ALL_REDUCE)
    procs = [
        start_cli(["run", "--cpu", "2", "--output", str(tmp_path / f"out{i}"), str(script)], cwd=tmp_path)
        for i in range(2)
    ]
    outputs = finish_all(procs, 90)
    ports = []
    for code, stdout, stderr in outputs:
        assert code == 0, stderr
        assert_gone(pids_in(stdout))
        found = set(re.findall(r"sum=3 port=(\d+)", stdout))
        assert len(found) == 1 and stdout.count("sum=3") == 2, stdout
        ports.append(found.pop())
    assert ports[0] != ports[1]


def test_module_mode(tmp_path: Path) -> None:
    pkg = tmp_path / "lib" / "mytrainer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    write_script(
        pkg,
        "main.py",
        """
        import os, sys
        print(f"pid={os.getpid()} module={__name__} spec={__spec__.name} rank={os.environ['RANK']} "
              f"args={sys.argv[1:]}", flush=True)
    """,
    )
    result = run_cli(
        ["run", "--cpu", "2", "--output", str(tmp_path / "out"), "-m", "mytrainer.main", "--cpu", "7", "x"],
        cwd=tmp_path,
        timeout=45,
        env={"PYTHONPATH": str(tmp_path / "lib")},
    )
    assert result.returncode == 0, result.stderr
    assert_gone(pids_in(result.stdout))
    for rank in range(2):
        assert f"[rank {rank}] pid=" in result.stdout
        expected = f"module=__main__ spec=mytrainer.main rank={rank} args=['--cpu', '7', 'x']"
        assert expected in result.stdout, result.stdout


def test_console_prefixes_whole_lines(tmp_path: Path) -> None:
    lines = 3000
    script = write_script(
        tmp_path,
        "chatty.py",
        f"""
        import os, sys
        rank = os.environ["RANK"]
        print(f"pid={{os.getpid()}}", flush=True)
        payload = "x" * 150
        for i in range({lines}):
            # partial writes of one line, unflushed bursts, and the other stream in between
            sys.stdout.write(f"r{{rank}} line {{i}} ")
            sys.stdout.write(payload + " end\\n")
            if i % 500 == 0:
                print(f"r{{rank}} err {{i}}", file=sys.stderr)
    """,
    )
    out = tmp_path / "out"
    result = run_cli(["run", "--cpu", "2", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert_gone(pids_in(result.stdout))
    pattern = re.compile(r"^\[rank (\d)\] (?:pid=\d+|r(\d) line (\d+) x{150} end)$")
    seen: dict[int, list[int]] = {0: [], 1: []}
    for line in result.stdout.splitlines():
        m = pattern.match(line)
        assert m, f"garbled console line: {line[:120]!r}"
        assert line.count("[rank ") == 1
        if m.group(2) is not None:
            assert m.group(1) == m.group(2)
            seen[int(m.group(1))].append(int(m.group(3)))
    for rank in (0, 1):
        assert seen[rank] == list(range(lines)), f"rank {rank}: lines lost or out of order"
        assert len(re.findall(rf"^\[rank {rank}\] r{rank} err \d+$", result.stderr, re.M)) == lines // 500
        log = (out / "logs" / "attempt_0" / f"rank_{rank}.log").read_text()
        assert log.count(" end\n") == lines


CPP_STACK = """[W1206 05:11:34.016 TCPStore.cpp:115] [c10d] recvVector failed: Connection reset by peer
Exception raised from recvBytes at /__w/torch/csrc/distributed/c10d/Utils.hpp:784 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7fbe75379b8d in libc10.so)
<omitting python frames>
frame #43: _start + 0x21 (0x5557554e4081 in python)
"""


def test_a_ranks_cpp_stack_is_one_console_line_and_whole_in_its_log(tmp_path: Path) -> None:
    """c10 appends a C++ backtrace to a failed store read's warning (CI saw one when a peer's node
    was killed mid-rendezvous): the console names it in one line, the rank's log keeps every frame."""
    script = write_script(
        tmp_path,
        "cpp.py",
        f"""
        import sys
        sys.stderr.write({CPP_STACK!r} + "\\n")
        print("after", file=sys.stderr)
    """,
    )
    out = tmp_path / "out"
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=45)
    assert result.returncode == 0, result.stderr
    assert "frame #" not in result.stderr and "Exception raised from" not in result.stderr, result.stderr
    assert "[rank 0] (torch's C++ stack from recvBytes: in this rank's log)\n[rank 0] after" in result.stderr
    assert "recvVector failed" in result.stderr
    log = (out / "logs" / "attempt_0" / "rank_0.log").read_text()
    assert CPP_STACK in log
    shown = run_cli(
        ["run", "--cpu", "1", "--output", str(out), str(script)],
        cwd=tmp_path,
        timeout=45,
        env={"TORCH_SHOW_CPP_STACKTRACES": "1"},
    )
    assert "[rank 0] frame #43: _start" in shown.stderr, shown.stderr  # asked for: shown whole


def test_log_ranks_limits_console_not_files(tmp_path: Path) -> None:
    script = write_script(tmp_path, "dump.py", ENV_DUMP)
    out = tmp_path / "out"
    result = run_cli(
        ["run", "--cpu", "2", "--log-ranks", "0", "--output", str(out), str(script)], cwd=tmp_path, timeout=45
    )
    assert result.returncode == 0, result.stderr
    pids = [json.loads((tmp_path / f"env_{r}.json").read_text())["pid"] for r in range(2)]
    assert_gone(pids)
    assert "[rank 0] stdout of rank 0" in result.stdout
    assert "[rank 0] stderr of rank 0" in result.stderr
    assert "[rank 1]" not in result.stdout and "[rank 1]" not in result.stderr
    log1 = (out / "logs" / "attempt_0" / "rank_1.log").read_text()
    assert "stdout of rank 1" in log1 and "stderr of rank 1" in log1


def _imported_torch(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Run ``multigpu ARGS`` under ``-X importtime``; the result (its stderr without the probe's lines) and
    whether the launcher imported torch. What makes a refusal brief is that it comes before torch and any
    worker; its time is measured in benchmarks/bench_badinput.py, not asserted on a shared machine."""
    result = subprocess.run(
        [MULTIGPU[0], "-X", "importtime", *MULTIGPU[1:], *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=20,
    )
    probe = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    modules = {line.rsplit("|", 1)[-1].strip() for line in probe}
    assert "multigpu.cli" in modules, result.stderr[-2000:]  # the probe works
    result.stderr = "".join(
        line for line in result.stderr.splitlines(keepends=True) if not line.startswith("import time:")
    )
    return result, any(m == "torch" or m.startswith("torch.") for m in modules)


BAD_INPUTS = [
    ["--cpu", "abc", "{script}"],
    ["--cpu", "0", "{script}"],
    ["--cpu", "-1", "{script}"],
    ["--gpus", "a", "{script}"],
    ["--gpus", "99", "{script}"],
    ["--cpu", "1"],
    ["--cpu", "1", "{missing}"],
    ["--cpu", "1", "--bogus", "{script}"],
    ["--cpu", "1", "--rdzv-endpoint", "localhost", "{script}"],
    ["--cpu", "1", "-m", "no_such_module_for_multigpu"],
]


@pytest.mark.parametrize("args", BAD_INPUTS, ids=[" ".join(a) for a in BAD_INPUTS])
def test_bad_input_exits_2_briefly(tmp_path: Path, args: list[str]) -> None:
    """Refused before torch is imported and before any worker starts (that is what keeps it brief)."""
    script = write_script(tmp_path, "ok.py", "print('must not run')\n")
    argv = ["run", *(a.format(script=script, missing=tmp_path / "missing.py") for a in args)]
    result, torch_imported = _imported_torch(argv, tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 4, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "must not run" not in result.stdout
    assert "error" in lines[0]
    assert not torch_imported, args
    assert not (tmp_path / "multigpu_runs").exists()


@pytest.mark.parametrize(
    ("typo", "meant"), [("--nproc-pernode", "--nproc-per-node"), ("--grace-perod", "--grace-period")]
)
def test_mistyped_option_gets_did_you_mean(tmp_path: Path, typo: str, meant: str) -> None:
    """Issue 22: a newcomer's typo is answered with the option meant, in one line, exit 2."""
    script = write_script(tmp_path, "ok.py", "print('must not run')\n")
    result = run_cli(["run", typo, "2", str(script)], cwd=tmp_path, timeout=20)
    assert result.returncode == 2, (result.stdout, result.stderr)
    first = result.stderr.splitlines()[0]
    assert first == f"multigpu run: error: unknown option '{typo}'; did you mean '{meant}'?", result.stderr
    assert "Traceback" not in result.stderr + result.stdout and "must not run" not in result.stdout


def test_demo_keeps_its_output_and_says_what_next(tmp_path: Path) -> None:
    """Issue 22: the newcomer's first run leaves its logs and run.json under ./multigpu_runs/ like any
    run, says where, and its last line says what to try next."""
    result = run_cli(["demo", "--cpu", "2", "--steps", "5"], cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stderr
    (out,) = (tmp_path / "multigpu_runs").iterdir()
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "succeeded" and record["command"][:2] == ["multigpu", "demo"]
    lines = result.stdout.splitlines()
    assert f"demo: logs in {out / 'logs'}, the run record in {out / 'run.json'}" in lines, result.stdout
    assert lines[-1].endswith(": multigpu run --cpu 2 examples/train_ddp.py"), result.stdout
    assert "[rank 0] done: loss" in result.stdout and "multigpu: summary" in result.stderr
    assert_gone([r["pid"] for r in record["attempts"][0]["ranks"].values()])


def test_gpus_without_gpu_says_use_cpu(tmp_path: Path) -> None:
    if visible_gpus():
        pytest.skip("this machine has a GPU")
    script = write_script(tmp_path, "ok.py", "")
    result = run_cli(["run", "--gpus", "0", str(script)], cwd=tmp_path, timeout=20)
    assert result.returncode == 2
    assert "--cpu N" in result.stderr


def test_taken_rdzv_port_is_refused_in_one_line(tmp_path: Path) -> None:
    script = write_script(tmp_path, "ok.py", "print('must not run')\n")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        result, torch_imported = _imported_torch(
            ["run", "--cpu", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", str(script)], tmp_path
        )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]
    assert "Traceback" not in result.stderr and "must not run" not in result.stdout
    assert not torch_imported


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["run", "--help"], ["devices"]])
def test_help_version_and_devices_do_not_import_torch(tmp_path: Path, args: list[str]) -> None:
    result, torch_imported = _imported_torch(args, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not torch_imported
    if args == ["--version"]:
        assert re.fullmatch(r"multigpu \S+\n", result.stdout)
    if args == ["--help"]:
        assert "run" in result.stdout and "devices" in result.stdout and "demo" in result.stdout
    if args == ["run", "--help"]:
        assert "--cpu" in result.stdout and "--rdzv-endpoint" in result.stdout
        head, *examples = result.stdout.splitlines()[:4]
        assert head == "examples:", result.stdout[:500]
        assert [e.split()[2] for e in examples] == ["--nproc-per-node", "--cpu", "--gpus"], examples


def test_devices_without_gpu(tmp_path: Path) -> None:
    if visible_gpus():
        pytest.skip("this machine has a GPU; tests/gpu covers the listing")
    result = run_cli(["devices"], cwd=tmp_path, timeout=20)
    assert result.returncode == 0
    assert "No GPU" in result.stdout and "--cpu N" in result.stdout


def test_module_mode_finds_a_package_in_the_current_directory(tmp_path: Path) -> None:
    """The installed `multigpu` command has no current directory on sys.path; workers do (python -m)."""
    import sys

    command = Path(sys.executable).parent / "multigpu"
    if not command.exists():
        pytest.skip("the multigpu console script is not installed next to this Python")
    pkg = tmp_path / "localpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write_script(
        pkg,
        "job.py",
        """
        import os
        print(f"pid={os.getpid()} ran {__spec__.name}", flush=True)
    """,
    )
    result = subprocess.run(
        [str(command), "run", "--cpu", "1", "--output", str(tmp_path / "out"), "-m", "localpkg.job"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert result.returncode == 0, result.stderr
    assert "ran localpkg.job" in result.stdout
    assert_gone(pids_in(result.stdout))
