"""Issue 41: time lost per failure. A campaign of faults drawn from Llama 3's interruption mix, injected
into one elastic job on a virtual network (``tests/netns_cluster.py``: a store host S, four training
hosts A-D, one CPU rank each), under multigpu and under torchrun 2.13 in the same harness.

    sudo .venv/bin/python benchmarks/fault_campaign.py [--faults N] [--seed S] [--out DIR]

Several faults per job, one at a time, each once the job has trained in a round of 4 for 2 s; the
same classes and targets in the same order for both launchers. Per fault: detection (the first line
a launcher printed, or the first rank started, after it), lost time (until every rank of the round
was past the highest step logged before it: ``campaign_stats.lost_after``), steps rolled back, the
faulted node's processes left once its launcher was gone, wrong verdicts (a healthy node named lost,
or a healthy node saying it lost the job). A lost node is repaired (its launcher started again) and
the time its return costs is measured too. A fault a launcher has not recovered from in ``BOUND_S``
is 'never'; the harness then ends that job and starts a fresh one (from the checkpoint) for the next
fault. Needs root (network namespaces); the harness runs in the root namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from campaign_job import (
    HOSTS,
    PYTHON,
    Job,
    NetnsCluster,
    Stamper,
    alive,
    available,
    env_for,
    sweep,
    write_train,
)
from campaign_report import markdown, summarize
from campaign_stats import BOUND_S, STALL_GAP_S, all_past, draw, lost_after

STEADY_S = 2.0
STORE_CUT_S = 5.0
LEFT_AFTER_S = 3.0
"""After a launcher's ``kill -9``: how long its ranks get to go before what is left is counted."""
LOST = re.compile(r"node \d+ was lost: its launcher \(host \S+, pid (\d+)\)")


def wait_for(cond: Any, bound: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return bool(cond())


def steady(job: Job, since: float) -> bool:
    """A round of 4 whose ranks all logged a step after ``since`` and have trained together for
    STEADY_S, still stepping now."""
    full = all_past([s for s in job.steps() if s.world == len(HOSTS) and s.t > since], -1)
    if full is None or time.time() - full < STEADY_S:
        return False
    recent = [s for s in job.steps() if s.t > time.time() - 1.0]
    return {s.host for s in recent} == set(HOSTS) and all(s.world == len(HOSTS) for s in recent)


def recovered(job: Job, fault_t: float) -> bool:
    """Every rank past its lost step, and no new stall since (a faulted node's rank may train on a
    little before the job stalls)."""
    back = lost_after(job.steps(), fault_t, time.time()).back_t
    return back is not None and time.time() - back > STALL_GAP_S


def inject(job: Job, kind: str, target: str) -> dict[str, Any]:
    """The fault; its time and the facts the observation needs (the faulted launcher's pid)."""
    rec: dict[str, Any] = {"launcher_pid": job.procs[target].pid if target in job.procs else None}
    if kind in ("gpu", "hang"):
        rec["rank_pid"] = job.rank_pid(target)
        os.kill(rec["rank_pid"], signal.SIGKILL if kind == "gpu" else signal.SIGSTOP)
    elif kind == "software":
        (job.folder / f"raise_{target}").touch()
    elif kind == "host":
        os.kill(job.procs[target].pid, signal.SIGKILL)
    elif kind == "network":
        job.net.link(target, up=False)
    rec["t"] = time.time()
    if kind == "store":
        job.net.link(target, up=False)
        time.sleep(STORE_CUT_S)
        job.net.link(target, up=True)
    return rec


def node_gone(job: Job, kind: str, target: str, rec: dict[str, Any]) -> None:
    """A lost node (host, network): wait for its launcher's end (a host: ``LEFT_AFTER_S`` for its
    ranks to go), count what is left of it, end that (the machine is off), and for a host move the
    fault's time to that moment (torchrun's orphaned rank trains on until then)."""
    proc = job.procs[target]
    if kind == "host":
        time.sleep(LEFT_AFTER_S)
    else:
        wait_for(lambda: proc.poll() is not None, BOUND_S)
        rec["cut_node_ended_s"] = time.time() - rec["t"] if proc.poll() is not None else None
        rec["cut_node_rc"] = proc.poll()
    rec["left"] = len(sweep(job.net, [target]))
    if kind == "host" and rec["left"]:
        rec["t"] = time.time()
    proc.wait(10)


def observe(job: Job, kind: str, target: str, rec: dict[str, Any]) -> None:
    """Wait (bounded) for recovery; fill in lost time, rolled-back steps, detection, what the faulted
    ranks left."""
    before = {s.pid for s in job.steps() if s.t <= rec["t"]}
    if kind in ("host", "network"):
        node_gone(job, kind, target, rec)
    ok = wait_for(lambda: recovered(job, rec["t"]), max(1.0, BOUND_S - (time.time() - rec["t"])))
    if kind == "hang" and alive(rec["rank_pid"]):
        os.kill(rec["rank_pid"], signal.SIGCONT)  # torchrun: never seen; let the job go on
    lost = lost_after(job.steps(), rec["t"], time.time())
    rec.update(lost_s=lost.lost_s if ok else None, rolled_back=lost.rolled_back)
    rec["stall_after_s"] = lost.stall_t - rec["t"]
    rec["last_step"] = lost.last_step
    after = {s.pid for s in job.steps() if s.t > rec["t"]}
    time.sleep(0.5)
    rec["left"] = rec.get("left", 0) + len([p for p in before - after if alive(p) and kind != "hang"])
    if kind == "hang" and alive(rec["rank_pid"]) and rec["rank_pid"] not in after:
        rec["left"] += 1
    said = [t for t, name, _ in job.stamper.lines if t > rec["t"] and not name.startswith(target)]
    firsts = [*said[:1], *job.starts_after(rec["t"])[:1]]
    rec["detect_s"] = min(firsts) - rec["t"] if firsts and min(firsts) - rec["t"] < BOUND_S else None


def rejoin(job: Job, target: str, rec: dict[str, Any]) -> None:
    """The repaired node: its link up, its launcher started again; the time the round of 3 lost to
    its return (from the 3-node round's last step to every rank of 4 past it)."""
    job.net.link(target, up=True)
    relaunched = time.time()
    job.start(target)
    if not wait_for(lambda: steady(job, relaunched), 60):
        rec["rejoin_s"] = None
        return
    three = [s for s in job.steps() if s.t > relaunched and s.world < len(HOSTS)]
    first4 = min(s.t for s in job.steps() if s.t > relaunched and s.world == len(HOSTS))
    t3 = max((s.t for s in three if s.t < first4), default=relaunched)
    back = lost_after(job.steps(), t3).back_t
    rec["rejoin_s"] = None if back is None else back - t3


def verdicts(job: Job, kind: str, target: str, rec: dict[str, Any], until: float) -> None:
    """Wrong verdicts between this fault and the next: a 'was lost' line naming a launcher that was
    not the faulted node's, or a healthy node saying it lost the job."""
    lines = [(name, ln) for t, name, ln in job.stamper.lines if rec["t"] - STORE_CUT_S <= t <= until]
    lost_node = rec["launcher_pid"] if kind in ("host", "network") else None
    named = [int(m.group(1)) for _, ln in lines if (m := LOST.search(ln))]
    rec["wrong"] = len({p for p in named if p != lost_node})
    rec["wrong"] += len({n for n, ln in lines if "lost the job" in ln and not n.startswith(target)})
    rec["lines"] = [f"{n}: {ln}" for n, ln in lines if "lost" in ln or "hang" in ln.lower()][:6]


def reset(job: Job) -> dict[str, Any]:
    """The job as a person would restart it after one that never recovered: every launcher ended
    (SIGTERM, 10 s), what is left of it swept, the links up, a fresh job from the checkpoint."""
    codes = job.end_all(10)
    swept = sweep(job.net, list(HOSTS))
    for host in HOSTS:
        job.net.link(host, up=True)
    job.start_all()
    return {"codes": codes, "swept": len(swept)}


def one_fault(job: Job, kind: str, target: str) -> dict[str, Any]:
    rec = inject(job, kind, target)
    rec.update(kind=kind, target=target)
    observe(job, kind, target, rec)
    if rec["lost_s"] is not None and kind in ("host", "network"):
        rejoin(job, target, rec)
    resumed = kind == "hang" and wait_for(lambda: recovered(job, rec["t"]), 10)  # after its SIGCONT
    if rec["lost_s"] is None and not resumed:
        rec["reset"] = reset(job)
    return rec


def campaign(job: Job, faults: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every fault in order, each once the job is steady; a job that does not get steady within 120 s
    is restarted (said in the record)."""
    done: list[dict[str, Any]] = []
    since = 0.0
    for kind, target in faults:
        if not wait_for(lambda: steady(job, since), 120):  # noqa: B023
            done.append({"kind": kind, "target": target, "skipped": "not steady within 120 s"})
            print(f"  {job.kind} {kind}@{target}: skipped, the job not steady within 120 s", flush=True)
            reset(job)
            continue
        host = "S" if kind == "store" and job.kind == "multigpu" else target
        rec = one_fault(job, kind, "A" if kind == "store" and job.kind == "torchrun" else host)
        since = time.time()
        verdicts(job, kind, rec["target"], rec, since)
        print(f"  {job.kind} {kind}@{rec['target']}: lost {fmt(rec['lost_s'])}, detect "
              f"{fmt(rec['detect_s'])}, rolled {rec['rolled_back']}, left {rec['left']}, "
              f"wrong {rec['wrong']}, rejoin {fmt(rec.get('rejoin_s'))}", flush=True)  # fmt: skip
        done.append(rec)
    return done


def fmt(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f} s"


def finish(job: Job) -> dict[str, Any]:
    """Every rank stops at one step (the stop file); launchers' exit codes, then the store ended and
    whatever is left in any namespace counted and swept."""
    (job.folder / "stop").touch()
    ended = wait_for(lambda: all(p.poll() is not None for p in job.procs.values()), 60)
    codes = {h: p.poll() for h, p in job.procs.items()}
    if not ended:
        job.end_all(10)
    time.sleep(1.0)
    left = sweep(job.net, list(HOSTS))
    if job.kind == "multigpu":
        job.net.procs[0].send_signal(signal.SIGTERM)
        job.net.procs[0].wait(10)
    return {"exit_codes": codes, "left_at_end": len(left), "stopped_by_stop_file": ended}


def run_launcher(kind: str, root: Path, faults: list[tuple[str, str]]) -> dict[str, Any]:
    folder = root / kind
    folder.mkdir()
    stamper = Stamper()
    stamper.start()
    with_net = NetnsCluster(["S", *HOSTS])
    try:
        job = Job(with_net, folder, kind, stamper)
        job.start_store()
        job.start_all()
        t0 = time.monotonic()
        records = campaign(job, faults)
        end = finish(job)
        return {"faults": records, "end": end, "wall_s": time.monotonic() - t0}
    finally:
        with_net.close()
        stamper.stop()


def user_restart_cost(root: Path, runs: int = 3) -> list[float]:
    """The user's own part of a restart: a clean start of the same script alone (python, world 1,
    env://) to its first step, from the harness's start of the process."""
    out = []
    for i in range(runs):
        folder = root / f"user{i}"
        folder.mkdir()
        env = env_for(folder, "A", "lo") | {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        env |= {"MASTER_PORT": str(29400 + i), "MAX_STEPS": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
        t0 = time.time()
        subprocess.run([PYTHON, str(write_train(folder))], env=env, timeout=120, check=True)
        first = [line for line in (folder / "steps_A.txt").read_text().splitlines() if "step=0" in line]
        out.append(float(first[0].split()[0]) - t0)
    return out


def on_term(*_: object) -> None:
    """SIGTERM (``timeout``, a CI's cancel): exit through the ``finally`` that removes the cluster, and
    let no second SIGTERM cut that removal short (``timeout`` signals the process and its group)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=8, help="faults per launcher (default 8)")
    parser.add_argument("--seed", type=int, default=41, help="the draw's seed (default 41)")
    parser.add_argument("--launchers", default="multigpu,torchrun")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: a scratch one)")
    parser.add_argument("--render", type=Path, default=None, help="only write the .md of this .json again")
    args = parser.parse_args()
    if args.render is not None:
        found = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(found))
        return 0
    signal.signal(signal.SIGTERM, on_term)
    why = available()
    if why is not None:
        parser.exit(2, f"fault_campaign.py: {why}\n")
    started = time.monotonic()
    rng = random.Random(args.seed)
    faults = [(kind, rng.choice(HOSTS)) for kind in draw(args.seed, args.faults)]
    root = Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    res: dict[str, Any] = {"seed": args.seed, "faults": faults, "load_start": load()}
    res["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    git = ["git", "rev-parse", "--short", "HEAD"]
    res["commit"] = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    res["user_restart_s"] = user_restart_cost(root)
    user = statistics.median(res["user_restart_s"])
    print(f"user's own restart cost (clean start to first step): {user:.2f} s", flush=True)
    res["runs"] = {}
    for kind in args.launchers.split(","):
        print(f"{kind}: {len(faults)} faults", flush=True)
        res["runs"][kind] = run_launcher(kind, root, faults)
    res["load_end"], res["wall_s"] = load(), time.monotonic() - started
    res["summary"] = summarize(res)
    out = args.out or Path(tempfile.mkdtemp(prefix="fault-campaign-results-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fault_campaign.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "fault_campaign.md").write_text(markdown(res))
    print(markdown(res))
    print(f"wall time {res['wall_s']:.0f} s; results in {out}; logs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
