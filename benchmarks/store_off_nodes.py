"""Issue 31: an elastic job loses node 0, with its store off the nodes (``multigpu store``) and under
torchrun's default (the store on node 0's agent).

    python benchmarks/store_off_nodes.py [--runs N] [--out DIR]

Three nodes on 127.0.0.1, one CPU rank each, ``--nnodes 2:3 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:P --rdzv-id bench --max-restarts 2 --nproc-per-node 1``. multigpu: ``multigpu store
127.0.0.1:P`` is started first and every launcher adds ``--rdzv-conf is_host=false`` (and ``--status
off --grace-period 1``, as ``elastic_cases.py``). torchrun: node 0 is started first and waited for
until it listens on P, so it hosts the store (torchrun's default). The worker prints ``pid=... world=W
restart=R at=<time.time()>`` after init_process_group, then all-reduces until it has taken a few steps in
a world of 2. Once all three ranks printed world=3, node 0's launcher (the first started) gets SIGKILL;
measured from the kill: until both survivors exited (bound 60 s), with their exit codes, and until
both survivors' ranks of a new round printed world=2 (their ``at=`` stamps; a round later than the
bound counts as never). Then the workers still alive whose launcher is gone are counted (torchrun's
outlive a killed agent) and ended. ``--rdzv-conf K=V,...`` adds settings to both launchers' line
(none by default: torch's defaults, last_call_timeout 30 s among them).

The harness is a child subreaper, so every orphan stays among its descendants: it signals only PIDs
it started or that are its descendants, and after each run it ends and counts any descendant left
(reported; it should be none). The variants alternate run by run. Results go to ``--out`` (default:
a new scratch folder) as ``store_off_nodes.md`` and ``.json``; nothing is written under benchmarks/.
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
from pathlib import Path
from typing import Any

import psutil
from common import (
    LAUNCHERS,
    LOOPBACK,
    MULTIGPU,
    PYTHON,
    TORCHRUN,
    Job,
    alternate,
    free_port,
    new_bench_dir,
    rmtree_quiet,
    start,
    summarize,
    torchrun_argv,
    wait_until,
    worker_env,
)
from report import cell, table

NODES = 3
EXIT_BOUND_S = 60.0
"""From the kill to both survivors' exit; past it they are ended by PID and count as hung. A new round
is looked for (in the ranks' ``at=`` stamps) until then: a round later than this counts as never."""
FORM_BOUND_S = 120.0
"""From the first start to all three ranks at world=3 (three torch imports on a loaded 2-core box)."""
TARGET_S = 10.0
WORKER = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    print(f"pid={os.getpid()} world={world} restart={os.environ['TORCHELASTIC_RESTART_COUNT']} "
          f"at={time.time():.3f}", flush=True)
    t, steps, deadline = torch.ones(1), 0, time.monotonic() + 180
    while (world != 2 or steps < 5) and time.monotonic() < deadline:
        dist.all_reduce(t)  # a training loop: talks to every peer, so a lost peer ends the round
        steps += 1
        time.sleep(0.1)
    print(f"done pid={os.getpid()} world={world}", flush=True)
    dist.destroy_process_group()
"""
NEW_ROUND = re.compile(r"\bworld=2 restart=(\d+) at=([\d.]+)")


def node_argv(launcher: str, port: int, script: Path, out: Path, conf: str = "") -> list[str]:
    """One node's command line: torchrun's elastic line, plus multigpu's store-off-the-nodes conf;
    ``conf`` (K=V,...) goes into both launchers' --rdzv-conf."""
    rdzv = [
        "--nnodes",
        "2:3",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{LOOPBACK}:{port}",
        "--rdzv-id",
        "bench",
        "--max-restarts",
        "2",
        "--nproc-per-node",
        "1",
    ]
    if launcher == TORCHRUN:
        return [*torchrun_argv(), *rdzv, *(["--rdzv-conf", conf] if conf else []), str(script)]
    ours = ",".join(filter(None, ["is_host=false", conf]))
    return [
        PYTHON,
        "-m",
        "multigpu",
        "run",
        *rdzv,
        "--rdzv-conf",
        ours,
        "--status",
        "off",
        "--grace-period",
        "1",
        "--output",
        str(out),
        str(script),
    ]


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on 127.0.0.1:port (the store is up)."""
    with contextlib.suppress(psutil.Error):
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
            for c in psutil.Process(pid).net_connections(kind="tcp")
        )
    return False


def start_store(bench_dir: Path, port: int) -> Job | None:
    """``multigpu store 127.0.0.1:port``, once it serves; None (ended) if it never did within 60 s."""
    store = start([PYTHON, "-m", "multigpu", "store", f"{LOOPBACK}:{port}"], bench_dir, log_name="store.log")
    if (
        wait_until(
            lambda: "serving the rendezvous store" in store.output() or store.popen.poll() is not None,
            60,
            poll=0.02,
        )
        is None
        or store.popen.poll() is not None
    ):
        store.finish()
        return None
    return store


def start_nodes(launcher: str, bench_dir: Path, port: int, script: Path, conf: str) -> list[Job]:
    """Three launchers, node 0 first; under torchrun node 0 is waited for until it hosts the store."""
    env = worker_env(bench_dir, {"PYTHONUNBUFFERED": "1"})
    nodes = [start(node_argv(launcher, port, script, bench_dir / "mg0", conf), bench_dir, env, "node0.log")]
    if launcher == TORCHRUN:
        wait_until(lambda: listening(nodes[0].pid, port) or nodes[0].popen.poll() is not None, 60, 0.02)
    for i in range(1, NODES):
        nodes.append(
            start(
                node_argv(launcher, port, script, bench_dir / f"mg{i}", conf), bench_dir, env, f"node{i}.log"
            )
        )
    return nodes


def printed_pids(nodes: list[Job]) -> list[int]:
    return sorted({int(p) for n in nodes for p in re.findall(r"\bpid=(\d+)", n.output())})


def descendants() -> dict[int, psutil.Process]:
    """Our live descendants (zombies count as gone), orphans included: the harness is a subreaper."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p
    return out


def survivors_round(nodes: list[Job], killed_at: float) -> float | None:
    """Seconds from the kill to the later of the two survivors' first world=2 rank, or None yet."""
    firsts = []
    for node in nodes[1:]:
        stamps = [float(at) for _, at in NEW_ROUND.findall(node.output()) if float(at) >= killed_at]
        if not stamps:
            return None
        firsts.append(min(stamps))
    return max(firsts) - killed_at


def after_kill(nodes: list[Job], killed_at: float) -> dict[str, Any]:
    """Wait (bounded) for the survivors' exit; then, from the ranks' stamps, when their new round formed;
    their codes and times from the kill."""
    exits: dict[int, float] = {}

    def exited() -> bool:
        for i, node in enumerate(nodes[1:], 1):
            if i not in exits and node.popen.poll() is not None:
                exits[i] = time.time() - killed_at
        return len(exits) == NODES - 1

    wait_until(exited, EXIT_BOUND_S, 0.02)
    round_s = survivors_round(nodes, killed_at)
    ok = len(exits) == NODES - 1 and all(nodes[i].popen.returncode == 0 for i in exits)
    return {
        "round_s": round_s if round_s is not None and round_s <= EXIT_BOUND_S else None,
        "exit_s": max(exits.values()) if ok else None,
        "exit_after_s": [exits.get(i) for i in range(1, NODES)],
        "exit_codes": [nodes[i].popen.returncode if i in exits else None for i in range(1, NODES)],
        "restarts": sorted({int(r) for n in nodes[1:] for r, _ in NEW_ROUND.findall(n.output())}),
    }


def parent(proc: psutil.Process) -> int | None:
    with contextlib.suppress(psutil.Error):
        return int(proc.ppid())
    return None


def orphans(nodes: list[Job], settle_s: float = 2.0) -> list[int]:
    """Printed worker PIDs still alive whose launcher is gone (after up to ``settle_s`` to go)."""
    launchers = {n.pid for n in nodes if n.popen.poll() is None}

    def left() -> list[int]:
        alive = descendants()
        return [p for p in printed_pids(nodes) if p in alive and parent(alive[p]) not in launchers]

    wait_until(lambda: not left(), settle_s, 0.05)
    return left()


def end_run(nodes: list[Job], store: Job | None) -> dict[str, Any]:
    """End every launcher and printed worker by PID, stop the store with SIGTERM; then end and count
    whatever else is left among our descendants, and reap adopted orphans."""
    workers = set(printed_pids(nodes))
    for node in nodes:
        node.finish()
    for pid, proc in descendants().items():
        if pid in workers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    store_rc = None
    if store is not None:
        store.popen.send_signal(signal.SIGTERM)
        store_rc = store.wait(10)
        store.finish()
    left = list(descendants().values())
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:  # adopted orphans are ours to reap
            pass
    return {"store_rc": store_rc, "swept": [p.pid for p in left]}


def one_run(root: Path, launcher: str, script: Path, conf: str) -> dict[str, Any]:
    """One job of three nodes: form at world 3, SIGKILL node 0's launcher, measure, end everything."""
    bench_dir, port = new_bench_dir(root, launcher), free_port()
    store = start_store(bench_dir, port) if launcher == MULTIGPU else None
    if launcher == MULTIGPU and store is None:
        return {"note": "multigpu store never served within 60 s", **end_run([], None)}
    nodes = start_nodes(launcher, bench_dir, port, script, conf)
    res: dict[str, Any] = {}
    try:
        formed = wait_until(lambda: all("world=3" in n.output() for n in nodes), FORM_BOUND_S, 0.02)
        if formed is None:
            res["note"] = f"the 3-node round never formed within {FORM_BOUND_S:.0f} s"
            return res
        res["form_s"] = formed - nodes[0].started
        killed_at = time.time()
        os.kill(nodes[0].pid, signal.SIGKILL)
        res.update(after_kill(nodes, killed_at))
        left = orphans(nodes)
        res.update(orphans=len(left), orphan_pids=left, node0_rc=nodes[0].popen.wait(10))
        res["note"] = note(res)
        return res
    finally:
        res.update(end_run(nodes, store))
        if res["swept"]:
            print(f"  {launcher}: ended {len(res['swept'])} leftover descendant(s) by PID", flush=True)
        (bench_dir / "result.json").write_text(json.dumps(res, indent=1))
        res["logs"] = {n.log_path.name: n.output()[-2000:] for n in nodes}


def note(r: dict[str, Any]) -> str:
    formed = (
        f"new round {r['round_s']:.2f} s after the kill (restart {r['restarts']})"
        if r["round_s"] is not None
        else f"no new round within {EXIT_BOUND_S:.0f} s"
    )
    ended = ", ".join(f"{s:.2f} s" if s is not None else "still running" for s in r["exit_after_s"])
    return (
        f"{formed}; survivors exited {ended} after it, rc={r['exit_codes']}; workers left running "
        f"with their launcher gone: {r['orphans']}"
    )


def measure(runs: int, root: Path, conf: str) -> dict[str, list[dict[str, Any]]]:
    script = root / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in LAUNCHERS}
    for i in range(runs):
        for launcher in alternate(i):
            r = one_run(root, launcher, script, conf)
            print(f"run {i + 1}/{runs} {launcher}: {r.get('note')}", flush=True)
            raw[launcher].append(r)
    return raw


def summary(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        k: {key: summarize([r.get(key) for r in v]) for key in ("form_s", "round_s", "exit_s")}
        | {"orphans": [r.get("orphans") for r in v], "swept": sum(len(r["swept"]) for r in v)}
        for k, v in raw.items()
    }


def markdown(res: dict[str, Any]) -> str:
    raw = res["raw"]
    ours = [r.get("round_s") for r in raw[MULTIGPU]]
    met = bool(ours) and all(s is not None and s <= TARGET_S for s in ours)

    def times(key: str) -> list[str]:
        return [cell([r.get(key) for r in raw[k]], "s") for k in LAUNCHERS]

    def per_run(key: str) -> list[str]:
        return [", ".join(str(r.get(key)) for r in raw[k]) for k in LAUNCHERS]

    rows = [
        ["first start to all 3 ranks at world=3", *times("form_s")],
        ["kill to both survivors' ranks at world=2 (the new round)", *times("round_s")],
        ["kill to both survivors' exit, both rc 0", *times("exit_s")],
        ["survivors' exit codes (per run)", *per_run("exit_codes")],
        ["workers left running, launcher gone (per run)", *per_run("orphans")],
        [
            "descendants the harness had to end after the run",
            *(str(sum(len(r["swept"]) for r in raw[k])) for k in LAUNCHERS),
        ],
    ]
    lines = [
        "# Node 0 lost: store off the nodes (multigpu) against torchrun's store on node 0",
        "",
        f"{res['when']}, {res['machine']}, {res['runs']} run(s) per launcher, load average at the "
        f"start {res['load']}, extra --rdzv-conf: {res['rdzv_conf'] or 'none'}. Cells: median "
        f"[min-max]; never: no number within {EXIT_BOUND_S:.0f} s of the kill.",
        "",
        f"Target (issue 31): node 0's loss to the new round <= {TARGET_S:.0f} s, every run: "
        f"**{'met' if met else 'missed'}** ({cell(ours, 's')}).",
        "",
        *table(["measure", "multigpu (`multigpu store`, is_host=false)", "torchrun (store on node 0)"], rows),
        "",
        "Runs:",
        "",
    ]
    lines += [f"- {k} run {i + 1}: {r.get('note')}" for k in LAUNCHERS for i, r in enumerate(raw[k])]
    return "\n".join(lines) + "\n"


def main() -> int:
    from multigpu.contract.prctl import set_child_subreaper

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per launcher (default 3)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the results (default: a new scratch folder, which the last line names)",
    )
    parser.add_argument(
        "--rdzv-conf",
        default="",
        metavar="K=V,...",
        help="added to both launchers' --rdzv-conf (e.g. last_call_timeout=1); default none",
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    set_child_subreaper()
    out = args.out or Path(tempfile.mkdtemp(prefix="store-off-nodes-results-"))
    root = Path(tempfile.mkdtemp(prefix="store-off-nodes-"))
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": args.runs,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "rdzv_conf": args.rdzv_conf,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    try:
        res["raw"] = measure(args.runs, root, args.rdzv_conf)
    finally:
        rmtree_quiet(root)
    res["summary"] = summary(res["raw"])
    res["left_after"] = sorted(descendants())
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_off_nodes.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "store_off_nodes.md").write_text(markdown(res))
    print(markdown(res))
    print(f"results in {out}; descendants alive at the end: {len(res['left_after'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
