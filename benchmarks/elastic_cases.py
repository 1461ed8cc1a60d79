"""Elastic cases side by side with torchrun: a late joiner, a peer's launcher SIGKILLed, a machine lost.

Two launchers on 127.0.0.1, ``--nnodes 1:2 --max-restarts 1``, c10d rendezvous, 2 CPU workers each.
Every run is bounded; whatever a launcher started is ended by PID afterwards (torchrun's workers
outlive a SIGKILLed agent, so their PIDs are read from what they printed).

    python benchmarks/elastic_cases.py [multigpu|torchrun ...] [--cases late,lost,machine] [--bound S]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
WORKER = """
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    print(f"pid={os.getpid()} rank={dist.get_rank()} world={world} group={os.environ['GROUP_RANK']} "
          f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} at={time.time():.2f}", flush=True)
    finish_at = int(sys.argv[1])  # the world size at which the job finishes
    t = torch.ones(1)
    deadline = time.monotonic() + 300
    while world != finish_at and time.monotonic() < deadline:
        dist.all_reduce(t)  # a training loop: talks to every peer
        time.sleep(0.05)
    dist.all_reduce(t)
    print(f"done pid={os.getpid()} rank={dist.get_rank()} world={world}", flush=True)
    dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def argv(launcher: str, port: int, script: Path, finish_at: int, out: Path) -> list[str]:
    rdzv = [
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "bench",
        "--max-restarts",
        "1",
        "--rdzv-conf",
        "join_timeout=60,last_call_timeout=1",
    ]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc-per-node", "2", *rdzv, str(script), str(finish_at)]
    return [
        str(BIN / "multigpu"),
        "run",
        "--cpu",
        "2",
        "--status",
        "off",
        "--grace-period",
        "1",
        "--output",
        str(out),
        *rdzv,
        str(script),
        str(finish_at),
    ]


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MULTIGPU_"))}
    env["PYTHONUNBUFFERED"] = "1"
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def text(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def wait_for(cond: object, bound: float) -> bool:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def cleanup(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> int:
    """End every launcher and every worker PID printed; return how many were still alive."""
    pids = {int(p) for log in logs for p in re.findall(r"\bpid=(\d+)", text(log))}
    alive = 0
    for proc in procs:
        if proc.poll() is None:
            alive += 1
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            alive += 1
    return alive


def late_join(launcher: str, work: Path, bound: float) -> dict[str, Any]:
    """A node alone runs, a second joins: seconds until both launchers ended, and until the round of
    both nodes had every rank initialised (``round_s``), from the second node's start."""
    script, port = work / "w.py", free_port()
    logs = [work / f"{launcher}_late_a.log", work / f"{launcher}_late_b.log"]
    a = start(argv(launcher, port, script, 4, work / "oa"), logs[0])
    procs = [a]
    try:
        if not wait_for(lambda: text(logs[0]).count("world=2") >= 2, 60):
            return outcome(None, None, "first node never ran alone within 60 s")
        joined, joined_at = time.monotonic(), time.time()
        procs.append(start(argv(launcher, port, script, 4, work / "ob"), logs[1]))
        ended = wait_for(lambda: all(p.poll() is not None for p in procs), bound)
        took = time.monotonic() - joined
        done = sum(text(log).count("done pid=") for log in logs)
        rcs = [p.poll() for p in procs]
        both = [
            float(t)
            for t in re.findall(r"world=4 group=\d+ restart=\d+ at=([\d.]+)", text(logs[0]) + text(logs[1]))
        ]
        if not ended:
            return outcome(None, None, f"NOT finished {bound:.0f} s after the join (ranks done: {done}/4)")
        round_s = max(both) - joined_at if len(both) >= 4 and rcs == [0, 0] else None
        formed = f"4 ranks initialised after {round_s:.1f} s, " if round_s is not None else ""
        return outcome(
            took if rcs == [0, 0] else None,
            round_s,
            f"both ended {took:.1f} s after the second node started ({formed}rc={rcs}, "
            f"ranks done at world 4: {done})",
        )
    finally:
        left = cleanup(procs, logs)
        if left:
            print(f"    ({launcher} late join: ended {left} leftover process(es) by PID)")


def outcome(seconds: float | None, round_s: float | None, note: str) -> dict[str, Any]:
    """One case's result: None where it did not finish as it should."""
    return {"seconds": seconds, "round_s": round_s, "note": note}


def lost_peer(launcher: str, work: Path, bound: float, whole_node: bool = False) -> dict[str, Any]:
    """SIGKILL the second node's launcher (with ``whole_node``, its ranks too, as when a machine dies):
    seconds until the survivor ended, and until its ranks were initialised alone (``round_s``)."""
    script, port = work / "w.py", free_port()
    tag = "machine" if whole_node else "lost"
    logs = [work / f"{launcher}_{tag}_a.log", work / f"{launcher}_{tag}_b.log"]
    a = start(argv(launcher, port, script, 2, work / "oa"), logs[0])
    time.sleep(0.5)  # the first one hosts the store
    b = start(argv(launcher, port, script, 2, work / "ob"), logs[1])
    procs = [a, b]
    try:
        if not wait_for(lambda: sum(text(log).count("world=4") for log in logs) >= 4, 90):
            return outcome(None, None, "the 2-node job never formed within 90 s")
        killed_at = time.time()
        os.kill(b.pid, signal.SIGKILL)
        for pid in map(int, re.findall(r"\bpid=(\d+)", text(logs[1])) if whole_node else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        ended = wait_for(lambda: a.poll() is not None, bound)
        took = time.monotonic() - killed
        done = text(logs[0]).count("done pid=")
        if not ended:
            return outcome(None, None, f"survivor NOT finished {bound:.0f} s after the peer's SIGKILL")
        alone = [float(t) for t in re.findall(r"world=2 group=\d+ restart=\d+ at=([\d.]+)", text(logs[0]))]
        ok = a.returncode == 0 and done == 2
        round_s = max(alone) - killed_at if alone and ok else None
        joined = f"its ranks re-initialised alone after {round_s:.1f} s, " if round_s is not None else ""
        return outcome(
            took if ok else None,
            round_s,
            f"survivor ended {took:.1f} s after the peer's SIGKILL ({joined}rc={a.returncode}, "
            f"its ranks done alone: {done})",
        )
    finally:
        left = cleanup(procs, logs)
        if left:
            print(f"    ({launcher} lost peer: ended {left} leftover process(es) by PID)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("launchers", nargs="*", default=["multigpu", "torchrun"])
    parser.add_argument("--cases", default="late,lost,machine", help="comma-separated: late, lost, machine")
    parser.add_argument("--bound", type=float, default=120.0, help="seconds before a case counts as hung")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="elastic_cases_"))
    (work / "w.py").write_text(textwrap.dedent(WORKER))
    cases = {
        "late": ("late join", lambda launcher: late_join(launcher, work, args.bound)),
        "lost": (
            "lost peer (its launcher SIGKILLed)",
            lambda launcher: lost_peer(launcher, work, args.bound),
        ),
        "machine": (
            "lost machine (launcher and ranks SIGKILLed)",
            lambda launcher: lost_peer(launcher, work, args.bound, whole_node=True),
        ),
    }
    for launcher in args.launchers:
        for case in args.cases.split(","):
            title, run = cases[case]
            print(f"{launcher}: {title}: {run(launcher)['note']}", flush=True)
    print(f"logs in {work}")


if __name__ == "__main__":
    main()
