"""Real launch lines from well-known projects, run under the real ``torchrun`` and under ``multigpu run``.

Only the launcher word is replaced. A probe stands in for each project's script: it prints its
environment contract and arguments and does one gloo all_reduce. Values a line leaves to the user
are filled in as the line's own script would (``$NGPU`` -> 2, a free port for ``$MASTER_PORT``); a
line is otherwise as published. Both launchers must give every rank the same contract, arguments
and result. torchrun is judged by the work its ranks did, not its exit code: after a script returns
it sometimes aborts in its own teardown.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import assert_gone, clean_env, free_port, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(240)]


@dataclass(frozen=True)
class Line:
    name: str
    source: str
    """Where the line was published (repository and path, or documentation page)."""
    argv: str
    """The arguments after ``torchrun``; {SCRIPT}, {MODULE}, {PORT}, {N} are filled in by the test."""
    nodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    """Environment the line runs in ({NODE} is the node's index, {PORT} the free port)."""


MATRIX = (
    Line(
        "ddp-tutorial",
        "pytorch/examples distributed/ddp-tutorial-series/README.md (Multi-GPU Torchrun)",
        "--nnodes=1 --nproc_per_node={N} {SCRIPT} 20 5",
    ),
    Line(
        "ddp-run-example",
        "pytorch/examples distributed/ddp-tutorial-series/run_example.sh",
        "--nnodes=1 --nproc_per_node={N} --rdzv_id=101 --rdzv_endpoint=localhost:{PORT} {SCRIPT}",
    ),
    Line(
        "modded-nanogpt",
        "KellerJordan/modded-nanogpt run.sh",
        "--standalone --nproc_per_node={N} {SCRIPT} --input_bin data/fineweb10B/fineweb_train_*.bin "
        "--model d12 --batch_size 32 --sequence_length 1024 --learning_rate 0.0015",
    ),
    Line(
        "nanogpt-config",
        "AGI-Arena/MARS scripts/run_adamw_small_fw.sh (nanoGPT style)",
        "--standalone --nproc_per_node={N} {SCRIPT} config/train_gpt2_small_adamw.py --batch_size=15 "
        "--gradient_accumulation_steps=4",
    ),
    Line(
        "torchtitan",
        "pytorch/torchtitan run_train.sh",
        "--nproc_per_node={N} --rdzv_backend c10d --rdzv_endpoint=localhost:0 --local-ranks-filter 0 "
        "--role rank --tee 3 -m {MODULE} --module llama3 --config llama3_debugmodel",
    ),
    Line(
        "megatron",
        "NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh",
        "--nproc_per_node {N} --nnodes 1 --master_addr localhost --master_port {PORT} {SCRIPT} "
        "--num-layers 96 --hidden-size 12288 --micro-batch-size 1 --split 949,50,1",
    ),
    Line(
        "timm",
        "huggingface/pytorch-image-models distributed_train.sh",
        "--nproc_per_node={N} {SCRIPT} /data/imagenet --model resnet50 -b 64",
    ),
    Line(
        "isc-demos",
        "StrongResearch/isc-demos tiny_training/run.sh",
        "--nnodes=1 --nproc_per_node=1 --rdzv_id=100 --rdzv_backend=c10d --rdzv_endpoint=localhost:{PORT} "
        "{SCRIPT}",
    ),
    Line(
        "sngp-dashes",
        "pkage/sngp-segmentation local_mpl_ddp.sh",
        "--rdzv-backend=c10d --rdzv-endpoint=localhost:0 --standalone --nnodes=1 --nproc-per-node={N} "
        "{SCRIPT} --batch_size 4 --test_batch_size 4 --epochs 10 --warmup 10",
    ),
    Line(
        "master-port-only",
        "JeMing-creater/ZTomorTrain run.sh",
        "--nproc_per_node {N} --master_port {PORT} {SCRIPT}",
    ),
    Line(
        "no-python",
        "torchrun --no-python ... python src/learn/train.py (RawByteClf training scripts)",
        "--no-python --nnodes=1 --nproc_per_node={N} python {SCRIPT} --root=./output --task=clf",
    ),
    Line(
        "lightning-two-nodes",
        "lightning.ai/docs/pytorch/latest/clouds/cluster_intermediate_2.html",
        "--nproc_per_node={N} --nnodes=2 --node_rank {NODE} --master_addr 127.0.0.1 --master_port {PORT} "
        "{SCRIPT} --arg1 --arg2",
        nodes=2,
    ),
    Line(
        "k8s-pet-env",
        "Kubeflow Trainer torch plugin: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, "
        "PET_MASTER_ADDR, PET_MASTER_PORT; the pod runs 'torchrun train_ddp.py'",
        "{SCRIPT}",
        nodes=2,
        env={
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": "{NODE}",
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": "{PORT}",
        },
    ),
    # c10d over several nodes: torch's elastic rendezvous, both nodes started together
    Line(
        "elastic-quickstart",
        "docs.pytorch.org/docs/stable/elastic/quickstart",
        "--nnodes=2 --nproc-per-node={N} --max-restarts=1 --rdzv-id=job --rdzv-backend=c10d "
        "--rdzv-endpoint=127.0.0.1:{PORT} {SCRIPT}",
        nodes=2,
    ),
    Line(
        "ddp-slurm",
        "pytorch/examples distributed/ddp-tutorial-series/slurm/sbatch_run.sh",
        "--nnodes 2 --nproc_per_node 1 --rdzv_id 2024 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{PORT} "
        "{SCRIPT} 50 10",
        nodes=2,
    ),
)


PROBE = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
VALUES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
          "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
          "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")
PRESENT = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")
record = {k: os.environ.get(k) for k in VALUES}
record.update({k + "?": bool(os.environ.get(k)) for k in PRESENT})
record.update(argv0=os.path.basename(sys.argv[0]), args=sys.argv[1:], sum=total.item(), pid=os.getpid(),
              master_port=os.environ.get("MASTER_PORT"))
with open(os.path.join(os.environ["PROBE_DIR"], "rank_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(record, f)
print("PROBE rank=%s sum=%s" % (os.environ["RANK"], total.item()), flush=True)
dist.destroy_process_group()
"""

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
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "MASTER_ADDR?",
    "MASTER_PORT?",
    "TORCHELASTIC_RUN_ID?",
    "TORCHELASTIC_ERROR_FILE?",
    "argv0",
    "args",
    "sum",
)
LAUNCHERS = {
    "torchrun": [str(Path(sys.executable).parent / "torchrun")],
    "multigpu": [sys.executable, "-m", "multigpu", "run"],
}


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


@dataclass
class Run:
    """One launcher's run of a line: a process per node, and what every rank reported."""

    port: str
    probe_dir: Path
    procs: list[subprocess.Popen[str]]
    outputs: list[str] = field(default_factory=list)
    ranks: dict[int, dict[str, object]] = field(default_factory=dict)


def _start_line(line: Line, launcher: str, work: Path, port: str) -> Run:
    """Start the line's launchers, one per node."""
    probe_dir = work / f"probe_{launcher}"
    probe_dir.mkdir()
    procs = []
    for node in range(line.nodes):
        values = {"SCRIPT": "train.py", "MODULE": "train_probe", "PORT": port, "N": "2", "NODE": str(node)}
        env = clean_env(
            {
                "PROBE_DIR": str(probe_dir),
                "MULTIGPU_STATUS": "off",
                "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                **{k: _fill(v, values) for k, v in line.env.items()},
            }
        )
        argv = [*LAUNCHERS[launcher], *shlex.split(_fill(line.argv, values))]
        procs.append(
            subprocess.Popen(
                argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return Run(port, probe_dir, procs)


def _finish(run: Run) -> Run:
    for proc in run.procs:
        try:
            run.outputs.append(proc.communicate(timeout=120)[0])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    run.ranks = {
        int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in run.probe_dir.glob("rank_*.json")
    }
    return run


@pytest.fixture
def work(tmp_path: Path) -> Path:
    write_script(tmp_path, "train.py", PROBE)
    write_script(tmp_path, "train_probe.py", PROBE)
    return tmp_path


SUITE_LINES = frozenset({"torchtitan", "no-python", "k8s-pet-env", "elastic-quickstart"})
"""The lines the README's suite runs, one per way of starting (``-m`` with --tee/--role/--local-ranks-filter
and c10d on port 0; --no-python; a PET_* environment over two static nodes; c10d over two nodes); the
others run in the heavy tier (scripts/fault_matrix.sh), so the suite stays under 8 minutes."""


def _tier(line: Line) -> object:
    marks = [] if line.name in SUITE_LINES else [pytest.mark.matrix]
    return pytest.param(line, id=line.name, marks=marks)


@pytest.mark.parametrize("line", [_tier(line) for line in MATRIX])
def test_line_runs_the_same_under_both_launchers(line: Line, work: Path) -> None:
    started = time.monotonic()
    ports = [str(free_port())]
    while len(ports) < 2:
        ports += [p for p in [str(free_port())] if p not in ports]
    # both launchers at once, each on a port of its own: half the wait
    runs = {name: _start_line(line, name, work, port) for name, port in zip(LAUNCHERS, ports, strict=True)}
    theirs, ours = (_finish(runs[name]) for name in LAUNCHERS)
    print(f"{line.name}: both launchers in {time.monotonic() - started:.1f}s")
    world = int(str(next(iter(theirs.ranks.values()))["WORLD_SIZE"])) if theirs.ranks else 0
    assert world and sorted(theirs.ranks) == list(range(world)), f"torchrun did not run it: {theirs.outputs}"
    assert sorted(ours.ranks) == sorted(theirs.ranks), f"multigpu ranks {sorted(ours.ranks)}: {ours.outputs}"
    for rank, expected in theirs.ranks.items():
        assert {k: ours.ranks[rank][k] for k in CONTRACT} == {k: expected[k] for k in CONTRACT}, rank
        if _static(line):  # the workers' MASTER_PORT is the line's port (c10d: torchrun picks a new one)
            assert ours.ranks[rank]["master_port"] == ours.port
            assert expected["master_port"] == theirs.port
    assert all(f"PROBE rank={r} " in "".join(ours.outputs) for r in _shown(line, world))
    assert_gone([int(str(r["pid"])) for run in (theirs, ours) for r in run.ranks.values()])


def _static(line: Line) -> bool:
    """A static rendezvous on a port the line names (c10d and --standalone choose their own)."""
    names_port = "{PORT}" in line.argv + str(line.env)
    return names_port and "c10d" not in line.argv and "--standalone" not in line.argv


def _shown(line: Line, world: int) -> list[int]:
    """The ranks the console shows: --local-ranks-filter hides the others, under both launchers."""
    return [0] if "--local-ranks-filter 0" in line.argv else list(range(world))


@pytest.mark.parametrize(
    "argv",
    [
        # pytorch/examples distributed/ddp-tutorial-series/run_multigpu_torchrun.sh
        "--standalone --nproc_per_node=gpu multigpu_torchrun.py 50 10",
        "--nnodes=1 --max_restarts=0 --rdzv_id=7 --rdzv_backend=c10d --nproc_per_node=gpu "
        "--rdzv_endpoint=localhost:0 -m train_probe",  # tedyhabtegebrial/ultra_light_trainer run_example.sh
    ],
)
def test_gpu_lines_are_refused_by_both_without_a_gpu(argv: str, work: Path) -> None:
    (work / "multigpu_torchrun.py").write_text(PROBE)
    env = clean_env({"PROBE_DIR": str(work), "CUDA_VISIBLE_DEVICES": ""})
    results = {
        name: subprocess.run(
            [*cmd, *shlex.split(argv)], cwd=work, env=env, capture_output=True, text=True, timeout=60
        )
        for name, cmd in LAUNCHERS.items()
    }
    assert results["torchrun"].returncode != 0 and "Cuda is not available" in results["torchrun"].stderr
    assert results["multigpu"].returncode == 2 and "no GPU is visible" in results["multigpu"].stderr
    assert not list(work.glob("rank_*.json"))


ECHO = """\
import os, sys
print("out from rank", os.environ["RANK"], flush=True)
print("err from rank", os.environ["RANK"], file=sys.stderr, flush=True)
"""


def _tree(root: Path) -> dict[str, str]:
    """The files under the one ``<run id>_<suffix>`` directory a launcher made, by relative path."""
    (run_dir,) = list(root.iterdir())
    return {str(p.relative_to(run_dir)): p.read_text() for p in sorted(run_dir.rglob("*.log"))}


def test_log_dir_redirects_and_tee_write_the_files_torchrun_writes(work: Path) -> None:
    """``--log-dir D -r 3 -t 0:1``, with duplicate filters: the same per-local-rank files with the same
    bytes, and the same ``filtered_*.log`` (teed lines only: rank 0's stdout); the console shows what
    torchrun's shows (rank 0's stdout only)."""
    write_script(work, "echo.py", ECHO)
    results = {}
    for name, cmd in LAUNCHERS.items():
        argv = [
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(work / name),
            "-r",
            "3",
            "-t",
            "0:1",
            "--duplicate-stdout-filters",
            "nothing,,at all,out from",
            "--duplicate_stderr_filters",
            "err",
            "echo.py",
        ]
        results[name] = subprocess.run(
            [*cmd, *argv],
            cwd=work,
            env=clean_env({"MULTIGPU_STATUS": "off"}),
            capture_output=True,
            text=True,
            timeout=120,
        )
    theirs, ours = _tree(work / "torchrun"), _tree(work / "multigpu")
    assert (
        sorted(theirs)
        == sorted(ours)
        == [
            "attempt_0/0/stderr.log",
            "attempt_0/0/stdout.log",
            "attempt_0/1/stderr.log",
            "attempt_0/1/stdout.log",
            "attempt_0/filtered_stderr.log",
            "attempt_0/filtered_stdout.log",
        ]
    )
    assert (
        ours["attempt_0/filtered_stdout.log"]
        == theirs["attempt_0/filtered_stdout.log"]
        == "[default0]:out from rank 0\n"
    )
    assert ours["attempt_0/filtered_stderr.log"] == theirs["attempt_0/filtered_stderr.log"] == ""
    for path, text in theirs.items():
        assert [line for line in ours[path].splitlines() if "rank" in line] == [
            line for line in text.splitlines() if "rank" in line
        ], path
    for name, result in results.items():
        assert "out from rank 0" in result.stdout, name
        assert "out from rank 1" not in result.stdout + result.stderr, name
        assert "err from rank" not in result.stdout + result.stderr, name


def test_directory_and_zip_targets_run_as_python_runs_them(work: Path) -> None:
    app = work / "app"
    app.mkdir()
    (app / "__main__.py").write_text(ECHO)
    with zipfile.ZipFile(work / "app.zip", "w") as archive:
        archive.writestr("__main__.py", ECHO)
    for target in ("app", "app.zip"):
        result = subprocess.run(
            [*LAUNCHERS["multigpu"], "--nproc-per-node", "2", target],
            cwd=work,
            env=clean_env({"MULTIGPU_STATUS": "off"}),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "out from rank 0" in result.stdout and "out from rank 1" in result.stdout


FLAT_SPECS = """\
import os
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs


class FlatLogsSpecs(DefaultLogsSpecs):
    \"\"\"Each redirected stdout straight in the log directory, as a plugin might put it.\"\"\"

    def reify(self, envs):
        dest = super().reify(envs)
        for rank, path in dest.stdouts.items():
            if path:
                dest.stdouts[rank] = os.path.join(self.root_log_dir, "flat_%d.out" % rank)
        return dest
"""


def test_logs_specs_plugin_decides_the_paths_under_both(work: Path) -> None:
    """``--logs-specs NAME`` loads the installed ``torchrun.logs_specs`` entry point and its paths are
    used, as torchrun uses them."""
    site = work / "site"
    info = site / "flat_logs-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flat-logs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nflat = flat_logs_specs:FlatLogsSpecs\n")
    (site / "flat_logs_specs.py").write_text(FLAT_SPECS)
    write_script(work, "echo.py", ECHO)
    for name, cmd in LAUNCHERS.items():
        argv = [
            "--nproc-per-node",
            "2",
            "--logs-specs",
            "flat",
            "--log-dir",
            str(work / name),
            "-r",
            "1",
            "echo.py",
        ]
        result = subprocess.run(
            [*cmd, *argv],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=120,
            env=clean_env({"MULTIGPU_STATUS": "off", "PYTHONPATH": str(site)}),
        )
        for rank in (0, 1):
            flat = work / name / f"flat_{rank}.out"
            assert flat.read_text().strip() == f"out from rank {rank}", (name, result.stderr)
        assert "out from rank" not in result.stdout, name  # redirected, not teed: off the console
