"""Fate sharing at scale, simulated on loopback: one c10d TCPStore and up to 1,000 simulated nodes.

Each simulated node is a real ``JobStore`` client with its own connection, running the real
``FateMonitor`` (``new``) or, call for call, the protocol it replaced (``old``; ``fate_sim.OldMonitor``).
The nodes live as threads in a few processes (``fate_sim.py``), so no launcher or worker is started.
Per case it measures, after a warm-up:

- store calls per second (counted by the clients) and the store process's CPU (psutil), over a steady
  window; a node that reports a failure in that window is a healthy job aborted;
- the time until every other node learned of one node's death (its beats stop);
- the time until every other node learned of one published failure (a failed rank's launcher).

Usage: python benchmarks/fate_scale.py [--nodes 10,100,1000] [--protocols old,new,full] [--steady 8]
Writes benchmarks/results/fate_scale.md and fate_scale.json. Binds 127.0.0.1 only; every process it
starts is ended by PID before it returns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "PYTHONWARNINGS": "ignore",
    "RES_OPTIONS": "timeout:1 attempts:1",
}
"""c10d looks up every connection's peer by reverse DNS (for its logs); where no resolver answers (a
sandbox), each lookup that times out holds a connect for the resolver's time-out (5 s by default)."""
LEARN_BOUND_S = 15.0
SERVER = """
import resource, sys
from datetime import timedelta
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False, use_libuv=True)
print(store.port, flush=True)
sys.stdin.read()
"""


class Child:
    """A process answering JSON lines; every read is bounded."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def ask(self, command: str | None, timeout: float = 900.0) -> dict[str, Any]:
        if command is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        try:
            return dict(json.loads(self.lines.get(timeout=timeout)))
        except queue.Empty:
            raise RuntimeError(f"no answer to {command!r} within {timeout:g}s") from None

    def end(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _split(nodes: int, procs: int) -> list[tuple[int, int]]:
    size = -(-nodes // procs)
    return [(first, min(size, nodes - first)) for first in range(0, nodes, size)]


def run_case(nodes: int, protocol: str, steady_s: float) -> dict[str, Any]:
    procs = 1 if nodes <= 10 else 4 if nodes <= 100 else nodes // 100
    server = subprocess.Popen(
        [PYTHON, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV
    )
    clients: list[Child] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        clients = [
            Child(
                [PYTHON, str(HERE / "fate_sim.py"), str(port), str(first), str(count), str(nodes), protocol]
            )
            for first, count in _split(nodes, procs)
        ]
        for client in clients:
            client.ask(None)
        case: dict[str, Any] = {"nodes": nodes, "protocol": protocol, "processes": procs}
        case.update(_steady(clients, psutil.Process(server.pid), steady_s, attempt=0))
        if case["aborted_healthy"]:
            return case
        case["death"] = _learn(clients, nodes, f"kill {nodes - 1}", "killed", nodes - 1)
        _all(clients, "stop")
        _all(clients, "start 1")
        time.sleep(1.0)
        case["published"] = _learn(clients, nodes, f"publish {nodes // 2}", "published", nodes // 2)
        return case
    finally:
        for client in clients:
            client.end()
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def _all(clients: list[Child], command: str) -> list[dict[str, Any]]:
    for client in clients:
        assert client.proc.stdin is not None
        client.proc.stdin.write(command + "\n")
        client.proc.stdin.flush()
    return [client.ask(None) for client in clients]


def _steady(clients: list[Child], server: psutil.Process, steady_s: float, attempt: int) -> dict[str, Any]:
    began = time.monotonic()
    _all(clients, f"start {attempt}")
    joined_s = time.monotonic() - began
    time.sleep(2.0)  # warm-up: first beats, the latency window fills
    before, cpu0, t0 = _all(clients, "count"), sum(server.cpu_times()[:2]), time.monotonic()
    time.sleep(steady_s)
    after, cpu1, t1 = _all(clients, "count"), sum(server.cpu_times()[:2]), time.monotonic()
    calls = sum(a["calls"] - b["calls"] for a, b in zip(after, before, strict=True))
    aborted = sum(a["learned"] for a in after)
    return {
        "join_s": round(joined_s, 2),
        "ops_per_s": round(calls / (t1 - t0)),
        "store_cpu_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "aborted_healthy": aborted,
        "p99_rtt_ms": round(1000 * max(a.get("max_p99_s", 0.0) for a in after), 1),
    }


def _learn(clients: list[Child], nodes: int, command: str, answer: str, origin: int) -> dict[str, Any]:
    """Send ``command`` to the process owning ``origin``; time until every other node learned."""
    owner = next(
        c
        for c, (first, count) in zip(clients, _split(nodes, len(clients)), strict=True)
        if first <= origin < first + count
    )
    t0 = float(owner.ask(command)[answer])
    deadline = t0 + LEARN_BOUND_S
    while time.monotonic() < deadline:
        if sum(c["learned"] for c in _all(clients, "count")) >= nodes - 1:
            break
        time.sleep(0.1)
    learned = [row for c in _all(clients, "report") for row in c["learned"] if row[0] != origin]
    delays = sorted(t - t0 for _, t, _, _ in learned)
    kinds = sorted({f"{kind} of node {node}" for _, _, kind, node in learned})
    return {
        "learned": len(learned),
        "of": nodes - 1,
        "kinds": kinds,
        "median_s": round(statistics.median(delays), 3) if delays else None,
        "max_s": round(delays[-1], 3) if len(delays) == nodes - 1 else None,
    }


def _cell(case: dict[str, Any], key: str) -> str:
    got = case.get(key)
    if got is None:
        return "n/a (the healthy job was aborted)" if case["aborted_healthy"] else "n/a"
    if got["max_s"] is None:
        return f"{got['learned']} of {got['of']} within {LEARN_BOUND_S:g} s"
    return f"{_seconds(got['median_s'])} / {_seconds(got['max_s'])}"


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 0.1 else f"{value:.2f} s"


def _table(cases: list[dict[str, Any]]) -> str:
    rows = [
        "| nodes | protocol | store ops/s | store CPU (% of a core) | store p99 RTT seen | healthy nodes "
        "aborted | every node knows of a death (median / max) | every node knows of a published "
        "failure (median / max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        death, published = _cell(c, "death"), _cell(c, "published")
        p99 = f"{c['p99_rtt_ms']} ms" if c["protocol"] != "old" else "-"
        rows.append(
            f"| {c['nodes']} | {c['protocol']} | {c['ops_per_s']:,} | {c['store_cpu_pct']} | {p99} | "
            f"{c['aborted_healthy']} of {c['nodes']} | {death} | {published} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="10,100,1000")
    parser.add_argument(
        "--protocols", default="old,new,full", help="old, new, full (a FateMonitor on every node)"
    )
    parser.add_argument(
        "--skip",
        default="1000:full",
        help="NODES:PROTOCOL cases not to run (default 1000:full: 3,000 monitor threads in "
        "10 Python processes measure their GIL, not the store)",
    )
    parser.add_argument("--steady", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cases = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for protocol in args.protocols.split(","):
            if f"{nodes}:{protocol}" in args.skip.split(","):
                continue
            began = time.monotonic()
            case = run_case(nodes, protocol, args.steady)
            case["took_s"] = round(time.monotonic() - began, 1)
            print(json.dumps(case), flush=True)
            cases.append(case)
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fate_scale.json").write_text(json.dumps({"machine": machine, "cases": cases}, indent=2))
    (args.out / "fate_scale.md").write_text(
        f"# Fate sharing at scale (benchmarks/fate_scale.py)\n\n{machine['cpus']} CPUs, "
        f"{machine['platform']}, load average at the end {machine['load_average']}, {machine['date']}.\n\n"
        f"{_table(cases)}\n"
    )
    print(_table(cases))


if __name__ == "__main__":
    main()
