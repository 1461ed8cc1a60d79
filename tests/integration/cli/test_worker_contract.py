"""torchrun's whole worker contract, diffed: the same environment dump under the real ``torchrun`` (the
torch in this venv) and under ``multigpu run``, in each mode, and torch's own file timer under both.

Every variable torchrun gives a worker must be in ours with torchrun's value, except the variables
``docs/migrating.md`` writes down as deliberate differences (its table under "The workers'
environment"), which must still be there. A newer torch that gives its workers another variable makes
this test fail until the launcher gives it too, or the docs say why not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import assert_gone, clean_env, free_port, write_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.matrix,
]  # the heavy tier

ROOT = Path(__file__).resolve().parents[3]
LAUNCHERS = {
    "torchrun": [str(Path(sys.executable).parent / "torchrun")],
    "multigpu": [sys.executable, "-m", "multigpu", "run"],
}
TIMER_ON = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1"}

DUMP = """\
import json, os
with open(os.path.join(os.environ["DUMP_DIR"], "rank_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(dict(os.environ), f)
"""


@dataclass(frozen=True)
class Mode:
    name: str
    argv: str
    """After the launcher word; {PORT} is a free port, {NODE} the node's index."""
    nodes: int = 1
    env: dict[str, str] = field(default_factory=dict)


MODES = (
    Mode("one-node", "--nproc-per-node 2 dump.py --lr 3"),
    Mode("one-node-file-timer", "--standalone --nproc-per-node 2 dump.py", env=TIMER_ON),
    Mode("module-signals", "--nproc-per-node 2 --signals-to-handle SIGTERM,SIGUSR1 --role trainer -m dump"),
    Mode("no-python-file-timer", "--no-python --nproc-per-node 2 python dump.py", env=TIMER_ON),
    Mode(
        "two-static-nodes",
        "--nnodes 2 --node-rank {NODE} --nproc-per-node 1 --master-addr 127.0.0.1 "
        "--master-port {PORT} --max-restarts 1 dump.py",
        nodes=2,
    ),
    Mode(
        "elastic",
        "--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{PORT} "
        "--rdzv-id job7 dump.py",
        nodes=2,
        env=TIMER_ON,
    ),
    Mode(
        "pet",
        "dump.py",
        nodes=2,
        env={
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": "{NODE}",
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": "{PORT}",
            "PET_MAX_RESTARTS": "2",
            "PET_SIGNALS_TO_HANDLE": "SIGUSR2",
        },
    ),
)


def deliberate_differences() -> set[str]:
    """The variables docs/migrating.md's table says differ by design (their first column)."""
    text = (ROOT / "docs" / "migrating.md").read_text()
    section = text.split("### The workers' environment", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([A-Z_]+)`", section, re.MULTILINE))


def _launch(mode: Mode, launcher: str, work: Path, port: int) -> tuple[list[subprocess.Popen[str]], Path]:
    dumps = work / f"dump_{launcher}"
    dumps.mkdir()
    procs = []
    for node in range(mode.nodes):
        fill = {"{PORT}": str(port), "{NODE}": str(node)}
        extra = {k: _fill(v, fill) for k, v in mode.env.items()}
        env = clean_env(
            {
                "DUMP_DIR": str(dumps),
                "MULTIGPU_STATUS": "off",
                **extra,
                "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            }
        )
        argv = shlex.split(_fill(mode.argv, fill))
        procs.append(
            subprocess.Popen(
                [*LAUNCHERS[launcher], *argv],
                cwd=work,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    return procs, dumps


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def _dumps(procs: list[subprocess.Popen[str]], dumps: Path) -> tuple[dict[int, dict[str, str]], str]:
    output = ""
    for proc in procs:
        try:
            output += proc.communicate(timeout=150)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in dumps.glob("rank_*.json")}, output


def contract_diff(theirs: dict[str, str], ours: dict[str, str], allowed: set[str]) -> list[str]:
    """What torchrun gives a worker that ours lacks, or gives otherwise outside ``allowed``."""
    problems = []
    for key, value in sorted(theirs.items()):
        if key == "DUMP_DIR":
            continue
        if key not in ours:
            problems.append(f"{key} missing (torchrun: {value!r})")
        elif ours[key] != value and key not in allowed:
            problems.append(f"{key}={ours[key]!r} (torchrun: {value!r})")
    return problems


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_every_variable_torchrun_gives_a_worker_ours_gets_too(mode: Mode, tmp_path: Path) -> None:
    write_script(tmp_path, "dump.py", DUMP)
    ports = {name: free_port() for name in LAUNCHERS}
    while len(set(ports.values())) < 2:
        ports["multigpu"] = free_port()
    started = {name: _launch(mode, name, tmp_path, port) for name, port in ports.items()}
    (theirs, their_output), (ours, our_output) = (_dumps(*started[name]) for name in LAUNCHERS)
    world = 2
    assert sorted(theirs) == list(range(world)), f"torchrun did not run it: {their_output}"
    assert sorted(ours) == list(range(world)), our_output
    allowed = deliberate_differences()
    assert {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_TIMER_FILE"} <= allowed
    mine, theirs_port = str(ports["multigpu"]), str(ports["torchrun"])
    for rank in range(world):  # the port the test named for each launcher is the one port
        same_port = {k: theirs_port if v == mine else v for k, v in ours[rank].items()}
        assert contract_diff(theirs[rank], same_port, allowed) == [], (rank, our_output)
        differ = {k: (v, same_port.get(k)) for k, v in theirs[rank].items() if same_port.get(k) != v}
        print(mode.name, rank, differ)  # the deliberate differences, as this run had them
        if "{PORT}" in mode.argv + str(mode.env):  # named: the workers' MASTER_PORT is it
            assert ours[rank]["MASTER_PORT"] == mine or "c10d" in mode.argv
    if mode.env.get("TORCHELASTIC_ENABLE_FILE_TIMER"):  # a path of the node's own, as torchrun's
        paths = {ours[r]["TORCHELASTIC_TIMER_FILE"] for r in range(world)}
        assert len(paths) == mode.nodes and all(p.startswith("/tmp/") for p in paths), paths
        assert not any(os.path.exists(p) for p in paths)  # removed when the attempt ended


def test_the_diff_names_a_variable_torchrun_sets_and_ours_lacks() -> None:
    """The comparison itself: a missing variable and a changed value both fail it; an allowed one and
    our own extras do not."""
    theirs = {"RANK": "0", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM", "TORCHELASTIC_RUN_ID": "abc"}
    ours = {"RANK": "0", "TORCHELASTIC_RUN_ID": "20260101", "MULTIGPU_RUN_ID": "20260101"}
    assert contract_diff(theirs, ours, {"TORCHELASTIC_RUN_ID"}) == [
        "TORCHELASTIC_SIGNALS_TO_HANDLE missing (torchrun: 'SIGTERM')"
    ]
    assert contract_diff(theirs, ours, set()) == [
        "TORCHELASTIC_RUN_ID='20260101' (torchrun: 'abc')",
        "TORCHELASTIC_SIGNALS_TO_HANDLE missing (torchrun: 'SIGTERM')",
    ]


TIMER = """\
import os, sys, time
import torch.distributed.elastic.timer as timer

rank = os.environ["RANK"]
with open(os.path.join(os.environ["DUMP_DIR"], "rank_%s.json" % rank), "w") as f:
    f.write('{"pid": %d, "entered": %f, "fifo": "%s"}' % (os.getpid(), time.time(),
                                                       os.environ["TORCHELASTIC_TIMER_FILE"]))
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with timer.expires(after=2, scope="timer.py#7"):
    time.sleep(60 if rank == "0" else 0.5)
print("rank", rank, "left its timer", flush=True)
time.sleep(60)
"""

TIMER_MODES = {
    "script": "--nproc-per-node 2 timer.py",
    "module": "--nproc-per-node 2 -m timer",
    "no-python": "--no-python --nproc-per-node 2 python timer.py",
}


@pytest.mark.parametrize("argv", list(TIMER_MODES.values()), ids=list(TIMER_MODES))
def test_a_rank_that_overstays_its_file_timer_ends_the_job_at_expiry(argv: str, tmp_path: Path) -> None:
    """torchrun's agent kills rank 0 at the expiry, then itself (rank 1 is left running: killed here).
    multigpu ends the job at the expiry too, every rank of it, and says why in one line."""
    write_script(tmp_path, "timer.py", TIMER)
    ends = {name: _timed_run(name, argv, tmp_path) for name in LAUNCHERS}
    (their_s, their_rc, their_output), (our_s, our_rc, output) = ends["torchrun"], ends["multigpu"]
    assert their_rc == -signal.SIGKILL and our_rc == 128 + signal.SIGKILL, (their_output, output)
    print(f"ended {their_s:.1f} s (torchrun) and {our_s:.1f} s (multigpu) after rank 0 set its timer")
    assert 1.9 < their_s < 10 and 1.9 < our_s < 10, (their_s, our_s)
    (root,) = [line for line in output.splitlines() if line.startswith("root cause:")]
    assert re.fullmatch(
        r"root cause: rank 0 \(node 0, pid \d+\) overstayed its 2 s timer "
        r"\(scope timer\.py#7\); killed",
        root,
    ), output
    assert "rank 1 left its timer" in output and "rank 0 left" not in output
    (record,) = tmp_path.glob("multigpu_runs/*/run.json")
    (incident,) = json.loads(record.read_text())["incidents"]
    assert "overstayed its 2 s timer" in json.dumps(incident)


def _timed_run(launcher: str, argv: str, work: Path) -> tuple[float, int, str]:
    """How long after rank 0 set its timer the launcher ended, its exit status, its output
    (a file: a rank torchrun leaves behind keeps a pipe open)."""
    dumps, log = work / f"dump_{launcher}", work / f"{launcher}.log"
    dumps.mkdir()
    env = clean_env(
        {
            "DUMP_DIR": str(dumps),
            "MULTIGPU_STATUS": "off",
            **TIMER_ON,
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        }
    )
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*LAUNCHERS[launcher], *shlex.split(argv)],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        rc = proc.wait(timeout=120)
    finally:
        ended = time.time()
        proc.kill()
        proc.wait()
    ranks = [json.loads(p.read_text()) for p in sorted(dumps.glob("rank_*.json"))]
    assert len(ranks) == 2, (launcher, log.read_text())
    if launcher == "torchrun":
        for rank in ranks:  # what torchrun's agent left behind when it killed itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank["pid"], signal.SIGKILL)
        Path(ranks[0]["fifo"]).unlink(missing_ok=True)
    else:
        assert not os.path.exists(ranks[0]["fifo"])  # removed with the attempt
    assert_gone([rank["pid"] for rank in ranks])
    return ended - ranks[0]["entered"], rc, log.read_text()  # rank 0's timer, set when it entered
