"""Issue 44: an elastic job on a 3-member etcd (torch's etcd-v2 rendezvous) loses one process.

    python benchmarks/etcd_node_loss.py [--launcher multigpu|torchrun|both] [--runs N] [--cases C,...]
                                        [--bound S] [--rdzv-conf K=V,...] [--out DIR]

Each run: a fresh etcd cluster (``LocalEtcd``, ``multigpu etcd``'s: three members with the v2 API on
127.0.0.1) and three nodes on 127.0.0.1, one CPU rank each, ``--nnodes 2:3 --rdzv-backend etcd-v2
--rdzv-conf last_call_timeout=1 --max-restarts 3``; torchrun names one member (a list it refuses with a
traceback, measured once), multigpu all three. Each rank all-reduces (gloo) and prints ``pid= group=
world= restart= step= at=<time>`` per step: 100 steps in round 1, 20 in a later one. Once all ranks
took 5 steps at world 3, the case strikes: ``healthy`` nothing; ``leader`` the etcd leader ``kill -9``;
``launcher`` node 0's launcher ``kill -9`` (node 0: whose rank printed group=0); ``node`` node 0 whole
(the launcher and all its descendants at once); ``leader+node`` both. Measured up to ``--bound`` after
the strike: until both survivors' new ranks started, and stepped at world 2; exit codes and times; the
survivors' console lines (steps aside) and tracebacks; ranks left without their launcher (2 s after,
and at the bound); launchers still running. Then the harness (a child subreaper) ends all by PID and
stops the cluster. Results in ``--out`` (default a scratch folder): ``etcd_node_loss.md``/``.json``,
where a launcher not run keeps its runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import psutil
from common import LAUNCHERS, MULTIGPU, PYTHON, TORCHRUN, Job
from report import cell, table

from multigpu.cli.etcd_cluster import LocalEtcd, find_etcd, members

CASES = ("healthy", "leader", "launcher", "node", "leader+node")
NODES = 3
ORPHAN_AT_S, FORM_BOUND_S = 2.0, 120.0  # orphans counted then after the strike; the round of 3's bound
WORKER = """
    import os, time, torch, torch.distributed as dist
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"start pid={os.getpid()} restart={restart} at={time.time():.3f}", flush=True)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    tag = f"pid={os.getpid()} group={os.environ['GROUP_RANK']} world={world} restart={restart}"
    t = torch.ones(1)
    for step in range(100 if restart == "0" else 20):
        dist.all_reduce(t)  # a training loop: talks to every peer, so a lost peer ends the round
        print(f"{tag} step={step} at={time.time():.3f}", flush=True)
        time.sleep(0.1)
    print(f"done {tag}", flush=True)
    dist.destroy_process_group()
"""
STARTED = re.compile(r"start pid=\d+ restart=(\d+) at=([\d.]+)")  # a survivor's new rank may say restart=0
STEP = re.compile(r"pid=(\d+) group=(\d+) world=(\d+) restart=(\d+) step=(\d+) at=([\d.]+)")


def node_argv(launcher: str, endpoints: list[str], script: Path, out: Path, conf: str) -> list[str]:
    """One node's line: torchrun's with its one member, multigpu's with the list."""
    rdzv = ["--nnodes", "2:3", "--rdzv-backend", "etcd-v2", "--rdzv-id", "bench", "--max-restarts", "3"]
    conf_args = ["--rdzv-conf", conf] if conf else []
    if launcher == TORCHRUN:
        head = [*common.torchrun_argv(), *rdzv, "--nproc-per-node", "1", "--rdzv-endpoint", endpoints[0]]
        return [*head, *conf_args, str(script)]
    flags = ["--status", "off", "--grace-period", "1", "--output", str(out)]
    line = ["run", "--cpu", "1", *rdzv, "--rdzv-endpoint", ",".join(endpoints), *conf_args, *flags]
    return [PYTHON, "-m", "multigpu", *line, str(script)]


def new_cluster() -> LocalEtcd:
    """A fresh 3-member cluster on six free loopback ports, once healthy."""
    ports: list[int] = []
    while len(ports) < 2 * NODES:
        if (port := common.free_port()) not in ports:
            ports.append(port)
    cluster = LocalEtcd(find_etcd() or "etcd", members(ports[:NODES], ports[NODES:]))  # main checked it
    cluster.start()
    problem = cluster.wait_ready(lambda: False)
    if problem is not None:
        cluster.close()
        raise SystemExit(f"etcd_node_loss: {problem}")
    return cluster


def steps(job: Job) -> list[tuple[int, int, int, int, int, float]]:
    """Every step line a node printed: (pid, group, world, restart, step, at)."""
    found = STEP.findall(job.output())
    return [(int(p), int(g), int(w), int(r), int(s), float(a)) for p, g, w, r, s, a in found]


def trained(nodes: list[Job]) -> bool:
    """Every node's rank has taken 5 steps in the round of 3."""
    return all(any(s[2] == NODES and s[4] >= 5 for s in steps(n)) for n in nodes)


def descendants(exclude: set[int]) -> dict[int, psutil.Process]:
    """Our live descendants but ``exclude`` (the etcd members); zombies count as gone."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.pid not in exclude and proc.status() != psutil.STATUS_ZOMBIE:
                out[proc.pid] = proc
    return out


def strike(case: str, nodes: list[Job], cluster: LocalEtcd) -> dict[str, Any]:
    """Do the case's kills at once; what was killed."""
    zero = next(i for i, n in enumerate(nodes) if any(s[1] == 0 and s[2] == NODES for s in steps(n)))
    leader = cluster.leader() if "leader" in case else None
    tree = [nodes[zero].pid] if case in ("launcher", "node", "leader+node") else []
    if "node" in case:
        tree += [p.pid for p in psutil.Process(nodes[zero].pid).children(recursive=True)]
    if leader is not None:
        cluster.kill(leader.name)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {"node0": zero, "leader": leader.name if leader is not None else None, "killed_pids": tree}


def both_at(nodes: list[Job], survivors: list[int], stamps: Callable[[Job], list[float]], at: float) -> Any:
    """Seconds from ``at`` to the later of the survivors' first stamps after it; None if one has none."""
    firsts = [min((t for t in stamps(nodes[i]) if t >= at), default=None) for i in survivors]
    return max(f for f in firsts if f is not None) - at if None not in firsts else None


def watch(nodes: list[Job], survivors: list[int], at: float, bound: float) -> dict[str, Any]:
    """Up to ``bound`` from ``at``: the survivors' exits, and when both trained in a round of 2."""
    exits: dict[int, float] = {}

    def exited() -> bool:
        for i in survivors:
            if i not in exits and nodes[i].popen.poll() is not None:
                exits[i] = time.time() - at
        return len(exits) == len(survivors)

    common.wait_until(exited, bound, 0.05)
    codes = [nodes[i].popen.poll() for i in range(NODES)]
    return {
        "round2_s": both_at(nodes, survivors, lambda n: [s[5] for s in steps(n) if s[2] == 2], at),
        "restart_s": both_at(
            nodes, survivors, lambda n: [float(a) for _, a in STARTED.findall(n.output())], at
        ),
        "exit_codes": codes,
        "exit_after_s": [exits.get(i) for i in range(NODES)],
        "done_s": max(exits.values()) if exited() and all(codes[i] == 0 for i in survivors) else None,
    }


def own_lines(job: Job) -> list[str]:
    """A node's output but its ranks' step and done lines: its launcher's own lines and tracebacks."""
    ours = (STEP, STARTED, re.compile(r"(start|done) pid="))
    return [x for x in job.output().splitlines() if x.strip() and not any(r.search(x) for r in ours)]


def printed(nodes: list[Job], survivors: list[int]) -> dict[str, Any]:
    """The lines on the survivors' consoles but the ranks' steps (the launchers' and the ranks' stderr),
    the tracebacks among them, and their ranks' last worlds."""
    own = [x for i in survivors for x in own_lines(nodes[i])]
    done = [
        int(w)
        for i in survivors
        for w in re.findall(r"done pid=\d+ group=\d+ world=(\d+)", nodes[i].output())
    ]
    traces = sum("Traceback (most recent call last)" in x for x in own)
    return {"lines": len(own), "tracebacks": traces, "done_worlds": done}


def left_running(nodes: list[Job], members_pids: set[int]) -> dict[str, Any]:
    """Launchers still running, and ranks still running whose own node's launcher is gone."""
    alive = descendants(members_pids)
    gone = [n for n in nodes if n.popen.poll() is not None]
    orphans = {s[0] for n in gone for s in steps(n)} & set(alive)
    return {"launchers_running": len(nodes) - len(gone), "orphans": len(orphans), "job_processes": len(alive)}


def end_run(nodes: list[Job], cluster: LocalEtcd) -> list[int]:
    """End every launcher and every other descendant but the members by PID, stop the cluster, reap."""
    for node in nodes:
        node.finish()
    left = list(descendants(set(cluster.pids().values())).values())
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    cluster.close()
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:  # adopted orphans are ours to reap
            pass
    return [p.pid for p in left]


def one_run(root: Path, launcher: str, case: str, script: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One job of three nodes on a fresh cluster: form, strike mid-training, measure, end everything."""
    bench_dir, cluster = common.new_bench_dir(root, f"{launcher}-{case.replace('+', '-')}"), new_cluster()
    env = common.worker_env(bench_dir, {"PYTHONUNBUFFERED": "1"})
    endpoints = [m.endpoint for m in cluster.members]
    nodes = []
    for i in range(NODES):
        argv = node_argv(launcher, endpoints, script, bench_dir / f"mg{i}", args.rdzv_conf)
        nodes.append(common.start(argv, bench_dir, env, f"node{i}.log"))
    res: dict[str, Any] = {"case": case}
    try:
        formed = common.wait_until(
            lambda: trained(nodes) or all(n.popen.poll() is not None for n in nodes), FORM_BOUND_S, 0.05
        )
        if formed is None or not trained(nodes):
            res["exit_codes"] = [n.popen.poll() for n in nodes]
            res["note"] = f"the round of 3 never trained; exit codes {res['exit_codes']}"
            res.update(printed(nodes, list(range(NODES))))
            return res
        res.update(form_s=formed - nodes[0].started, strike_at=(at := time.time()))
        res.update(strike(case, nodes, cluster))
        lost = [res["node0"]] if case in ("launcher", "node", "leader+node") else []
        survivors, res["lost"] = [i for i in range(NODES) if i not in lost], lost
        time.sleep(ORPHAN_AT_S)  # the moment the orphans are counted, not an ordering
        res["orphans_at_2s"] = left_running(nodes, set(cluster.pids().values()))["orphans"]
        res.update(watch(nodes, survivors, at, args.bound))
        res.update(printed(nodes, survivors))
        res.update(left_running(nodes, set(cluster.pids().values())))
        res["note"] = note(res, args.bound)
        return res
    finally:
        res["swept"] = end_run(nodes, cluster)
        keep = [
            [x for x in n.output().splitlines() if not STEP.search(x) and "frame #" not in x] for n in nodes
        ]
        res["logs"] = {n.log_path.name: "\n".join(k)[-5000:] for n, k in zip(nodes, keep, strict=True)}
        (bench_dir / "result.json").write_text(json.dumps(res, indent=1))


def note(r: dict[str, Any], bound: float) -> str:
    new, trains = (f"{r[k]:.2f} s" if r[k] is not None else "never" for k in ("restart_s", "round2_s"))
    formed = f"new ranks {new}, training at world 2 {trains}" if r["lost"] else "no node lost"
    ends = ", ".join(
        "lost" if i in r["lost"] else f"{s:.1f} s" if s is not None else "running"
        for i, s in enumerate(r["exit_after_s"])
    )
    return (
        f"{formed}; exits {ends} after the strike (bound {bound:.0f} s), rc={r['exit_codes']}; "
        f"{r['lines']} console line(s), {r['tracebacks']} traceback(s); at the bound "
        f"{r['launchers_running']} launcher(s) running, {r['orphans']} orphaned rank(s) "
        f"({r['orphans_at_2s']} at 2 s); survivors' ranks finished at world {r['done_worlds']}"
    )


def torchrun_list(root: Path, script: Path) -> str:
    """torchrun given the three members, as multigpu takes them: its exit code, lines, traceback."""
    bench_dir, cluster = common.new_bench_dir(root, "torchrun-list"), new_cluster()
    argv = node_argv(TORCHRUN, [m.endpoint for m in cluster.members], script, bench_dir, "")
    argv[argv.index("--rdzv-endpoint") + 1] = cluster.endpoint
    job = common.start(argv, bench_dir, common.worker_env(bench_dir), "list.log")
    try:
        code = job.wait(60)
        lines = [x for x in job.output().splitlines() if x.strip()]
        last = next((x for x in reversed(lines) if "Error" in x), lines[-1] if lines else "")
        traceback = "a traceback" if "Traceback" in job.output() else "no traceback"
        return f"exit {code}, {len(lines)} lines, {traceback}; the last error line: `{last}`"
    finally:
        job.finish()
        cluster.close()


def measure(args: argparse.Namespace, launchers: list[str], root: Path) -> dict[str, Any]:
    script = root / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {k: {c: [] for c in args.cases} for k in launchers}
    for i in range(args.runs):
        for case in args.cases:
            for launcher in launchers if i % 2 == 0 else launchers[::-1]:
                r = one_run(root, launcher, case, script, args)
                print(f"run {i + 1}/{args.runs} {launcher} {case}: {r.get('note')}", flush=True)
                raw[launcher][case].append(r)
    out: dict[str, Any] = {"raw": raw}
    if TORCHRUN in launchers:
        out["torchrun_list"] = torchrun_list(root, script)
        print(f"torchrun with the list: {out['torchrun_list']}", flush=True)
    return out


def per_run(runs: list[dict[str, Any]], *keys: str) -> str:
    return "; ".join(" / ".join(str(r.get(k)) for k in keys) for r in runs) or "not run"


ROWS: tuple[tuple[str, Callable[[list[dict[str, Any]]], str]], ...] = (
    ("round of 3 never trained (runs)", lambda v: str(sum("form_s" not in r for r in v)) if v else "not run"),
    ("strike to a new round's ranks started", lambda v: cell([r.get("restart_s") for r in v], "s")),
    ("strike to a round of 2 training", lambda v: cell([r.get("round2_s") for r in v], "s")),
    ("strike to the survivors' exit, all rc 0", lambda v: cell([r.get("done_s") for r in v], "s")),
    ("exit codes by start order; node 0's index (per run)", lambda v: per_run(v, "exit_codes", "node0")),
    ("console lines, steps aside / tracebacks (per run)", lambda v: per_run(v, "lines", "tracebacks")),
    ("ranks left without their launcher 2 s after the strike", lambda v: per_run(v, "orphans_at_2s")),
    ("at the bound: launchers running / orphans", lambda v: per_run(v, "launchers_running", "orphans")),
    ("the survivors' ranks' last round: world (per run)", lambda v: per_run(v, "done_worlds")),
)


def case_rows(raw: dict[str, dict[str, list[dict[str, Any]]]], case: str) -> list[list[str]]:
    """The case's rows, each over the runs that struck; no new round is looked for where no node is lost."""
    rows = ROWS if case not in ("healthy", "leader") else ROWS[:1] + ROWS[3:]
    runs = [raw.get(k, {}).get(case, []) for k in LAUNCHERS]
    struck = [[r for r in v if "form_s" in r] for v in runs]
    return [[f"{case}: {label}", *map(fn, runs if i == 0 else struck)] for i, (label, fn) in enumerate(rows)]


def markdown(res: dict[str, Any]) -> str:
    raw, listed = res["raw"], res.get("torchrun_list")
    rows = [row for c in CASES if any(c in raw.get(k, {}) for k in LAUNCHERS) for row in case_rows(raw, c)]
    when = "; ".join(
        f"{k}: {m['when']}, load {m['load']}, runs " + ", ".join(f"{c} {len(v)}" for c, v in raw[k].items())
        for k, m in res["meta"].items()
    )
    lines = [
        "# Any one process lost: an elastic job on a 3-member etcd (etcd-v2 rendezvous)",
        "",
        f"{when}. {res['machine']}, torch {res['torch']}, {res['etcd']}, --rdzv-conf {res['rdzv_conf']}, "
        f"bound {res['bound']:.0f} s after the strike. Cells: median [min-max]; never: no number within the "
        "bound. Exit codes: None = still running at the bound (then ended by the harness), -9 = the case's "
        "kill. A run whose round of 3 never trained is counted in its first row and left out of the others.",
        "",
        *table(["measure", "multigpu (the three members)", "torchrun (one member)"], rows),
        "",
        f"torchrun given the three members (`--rdzv-endpoint H1:P1,H2:P2,H3:P3`): {listed or 'not run'}",
        "",
        "Runs:",
        "",
    ]
    runs = [(k, c, i, r) for k in LAUNCHERS for c, v in raw.get(k, {}).items() for i, r in enumerate(v)]
    return "\n".join(lines + [f"- {k} {c} run {i + 1}: {r.get('note')}" for k, c, i, r in runs]) + "\n"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=(MULTIGPU, TORCHRUN, "both"), default="both")
    parser.add_argument("--runs", type=int, default=1, help="runs per case and launcher (default 1)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)} (default all)")
    parser.add_argument("--bound", type=float, default=60.0, help="seconds watched after the strike (60)")
    parser.add_argument("--rdzv-conf", default="last_call_timeout=1", help="both launchers' --rdzv-conf")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: a scratch folder)")
    args = parser.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    if args.runs < 1 or not args.cases or any(c not in CASES for c in args.cases):
        parser.error(f"--runs must be at least 1 and --cases among {', '.join(CASES)}")
    return args


def main() -> int:
    import torch

    from multigpu.contract.prctl import set_child_subreaper

    args = parse()
    if find_etcd() is None:
        raise SystemExit("etcd_node_loss: no etcd binary (apt-get install etcd-server)")
    set_child_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through every finally: all ended by PID
    launchers = list(LAUNCHERS) if args.launcher == "both" else [args.launcher]
    out = args.out or Path(tempfile.mkdtemp(prefix="etcd-node-loss-results-"))
    old = out / "etcd_node_loss.json"
    res: dict[str, Any] = json.loads(old.read_text()) if old.exists() else {"raw": {}, "meta": {}}
    etcd = find_etcd()
    res.update(
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        torch=torch.__version__,
        etcd=os.popen(f"{etcd} --version").readline().strip() if etcd else "no etcd",
        rdzv_conf=args.rdzv_conf,
        bound=args.bound,
    )
    when, load = (
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        " ".join(f"{x:.2f}" for x in os.getloadavg()),
    )
    res["meta"].update({k: {"when": when, "load": load} for k in launchers})
    root = Path(tempfile.mkdtemp(prefix="etcd-node-loss-"))
    try:
        got = measure(args, launchers, root)
    finally:
        common.rmtree_quiet(root)
    for k, cases in got.pop("raw").items():  # a case run again replaces its runs; the others stay
        res["raw"].setdefault(k, {}).update(cases)
    res.update(got)
    out.mkdir(parents=True, exist_ok=True)
    old.write_text(json.dumps(res, indent=1) + "\n")
    (out / "etcd_node_loss.md").write_text(markdown(res))
    print(markdown(res))
    print(f"results in {out}; descendants alive at the end: {len(descendants(set()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
