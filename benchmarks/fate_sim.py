"""One process of simulated nodes for ``fate_scale.py``: each node is a real ``JobStore`` client of the
one store (its own connections), running one of:

- ``old``: the protocol this change replaced, call for call (every node reads every other node's counter
  and done flag each round, and calls the store lost when a round takes over 1.5 s);
- ``full``: today's ``FateMonitor`` on every node (three threads each);
- ``new``: today's ``FateMonitor`` on the watcher (node 0); every other node makes exactly the store
  calls ``FateMonitor`` makes on a node that is not the watcher (one ``add`` per beat, one blocking
  ``wait``, the abort record read when woken), from one beat thread per process and one waiter thread
  per node, without the deadman (a local clock, no store call). Hundreds of monitors' threads in one
  Python process measure that process's GIL, not the protocol: a real node is a process of its own.

Commands come one per line on stdin; answers are JSON lines on stdout.

    start ATTEMPT      join attempt ATTEMPT with every node of this process and start its monitors
    count              store calls made so far by this process's nodes
    kill NODE          stop NODE's beats (as if its launcher died), print the time
    publish NODE       NODE publishes a failure (as a failed rank's launcher does), print the time
    report             every node that learned of a failure: node, time, error type, failed node
    stop               stop every monitor
    exit
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from multigpu.contract.failure import WorkerFailure
from multigpu.rendezvous.failure_sharing import (
    BEAT_S,
    FateMonitor,
    failure_from_record,
    failure_record,
    node_lost,
    store_lost,
)
from multigpu.rendezvous.job import JobStore

OLD_BEAT_S, OLD_LOST_AFTER_S = 0.2, 1.5


class Counted:
    """A store client that counts its calls (one counter per process, shared by its clients)."""

    def __init__(self, store: Any, counter: list[int]) -> None:
        self._store, self._counter = store, counter

    def clone(self) -> Counted:
        return Counted(self._store.clone(), self._counter)

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            self._counter[0] += 1
            return call(*args)

        return counted


class OldMonitor:
    """The protocol before this change, call for call: per round a beat, the abort record, the members,
    and for every other node its done flag and its beat counter; a round over 1.5 s is a lost store."""

    def __init__(self, job: JobStore, on_failure: Callable[[WorkerFailure], None]) -> None:
        self.job, self._on_failure = job, on_failure
        self._stop = threading.Event()
        self._fired = False
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}
        self._last_ok = time.monotonic()
        self._threads = [
            threading.Thread(target=self._run, daemon=True),
            threading.Thread(target=self._deadman, daemon=True),
        ]

    def start(self) -> None:
        self._last_ok = time.monotonic()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _fire(self, failure: WorkerFailure) -> None:
        with self._lock:
            if self._fired or self._stop.is_set():
                return
            self._fired = True
        self._on_failure(failure)

    def _deadman(self) -> None:
        while not self._stop.wait(OLD_BEAT_S):
            if time.monotonic() - self._last_ok > OLD_LOST_AFTER_S:
                self._fire(store_lost("a round took over 1.5 s"))
                return

    def _run(self) -> None:
        store, job = self.job.store, self.job
        while not self._stop.wait(OLD_BEAT_S):
            try:
                store.add(job.key("beat", job.base_rank), 1)
                if store.check([job.key("abort")]):
                    self._fire(WorkerFailure.from_dict(json.loads(store.get(job.key("abort")))))
                    return
                raw = store.get(job.key("members")).decode()
                members = {int(b): int(n) for b, n in (item.split(":") for item in raw.split(",") if item)}
                if self._lost(members):
                    return
                self._last_ok = time.monotonic()
            except Exception:
                self._fire(store_lost("the store call failed"))
                return

    def _lost(self, members: dict[int, int]) -> bool:
        store, job, now = self.job.store, self.job, time.monotonic()
        for base, node in members.items():
            if base == job.base_rank or store.check([job.key("done", base)]):
                continue
            count = int(store.add(job.key("beat", base), 0))
            last, since = self._seen.get(base, (-1, now))
            if count != last:
                self._seen[base] = (count, now)
            elif now - since > OLD_LOST_AFTER_S:
                self._fire(node_lost(node, f"node {node} stopped beating"))
                return True
        return False


class LightNodes:
    """Nodes that are not the watcher, making ``FateMonitor``'s store calls: a beat each, per ``BEAT_S``
    (one thread for all), and one waiter thread each, blocked in ``wait`` on its wake key."""

    def __init__(
        self, jobs: dict[int, JobStore], on: Callable[[int], Callable[[WorkerFailure], None]]
    ) -> None:
        self.jobs, self._on = jobs, on
        self.killed: set[int] = set()
        self._stop = threading.Event()
        self._done: set[int] = set()
        self._threads = [
            threading.Thread(target=self._beat, daemon=True),
            *(threading.Thread(target=self._wait, args=(base,), daemon=True) for base in jobs),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            for base, job in self.jobs.items():
                if base not in self.killed:
                    job.beat()

    def _wait(self, base: int) -> None:
        own = self.jobs[base].with_own_client()
        while not self._stop.is_set():
            record = own.read_abort()
            if record is not None:
                self._on(base)(failure_from_record(record))
                self._done.add(base)
                return
            own.wait_woken()

    def stop(self) -> None:
        self._stop.set()
        for base, job in self.jobs.items():
            if base not in self._done:
                job.wake_self()
        for thread in self._threads:
            thread.join(5)
        for base, job in self.jobs.items():
            if base not in self._done:
                job.clear_wake()


class Nodes:
    """This process's simulated nodes: one store client (and one monitor) each."""

    def __init__(self, port: int, first: int, count: int, total: int, protocol: str) -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        self.total, self.protocol = total, protocol
        self.calls = [0]
        self.clients = [
            Counted(TCPStore("127.0.0.1", port, None, False, timedelta(seconds=300)), self.calls)
            for _ in range(count)
        ]
        self.bases = list(range(first, first + count))
        self.monitors: dict[int, Any] = {}
        self.light: LightNodes | None = None
        self.jobs: dict[int, JobStore] = {}
        self.learned: dict[int, tuple[float, str, int]] = {}
        self._lock = threading.Lock()

    def start(self, attempt: int) -> None:
        jobs = {}
        for base, client in zip(self.bases, self.clients, strict=True):
            job = JobStore(client, node=base, base_rank=base, nproc=1, world_size=self.total)
            job.run_id = "bench"
            jobs[base] = job.for_attempt(attempt)
        threads = [threading.Thread(target=job.join, args=(300.0, 0.2)) for job in jobs.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.jobs, self.learned = jobs, {}
        kind = OldMonitor if self.protocol == "old" else FateMonitor
        full = self.protocol != "new"
        self.monitors = {base: kind(job, self._on(base)) for base, job in jobs.items() if full or base == 0}
        self.light = None if full else LightNodes({b: j for b, j in jobs.items() if b != 0}, self._on)
        for monitor in self.monitors.values():
            monitor.start()
        if self.light is not None:
            self.light.start()

    def _on(self, base: int) -> Callable[[WorkerFailure], None]:
        def learned(failure: WorkerFailure) -> None:
            with self._lock:
                self.learned.setdefault(base, (time.monotonic(), str(failure.error_type), failure.node))

        return learned

    def stop(self) -> None:
        for monitor in self.monitors.values():
            monitor.stop()
        if self.light is not None:
            self.light.stop()

    def kill(self, base: int) -> None:
        if base in self.monitors:
            self.monitors[base].stop()
        else:
            assert self.light is not None
            self.light.killed.add(base)

    def publish(self, base: int) -> float:
        failure = WorkerFailure(
            rank=base,
            local_rank=0,
            pid=None,
            node=base,
            error_type="RuntimeError",
            message="a simulated rank failure",
            time=time.time(),
        )
        began = time.monotonic()
        self.jobs[base].publish_abort(failure_record(failure))
        return began

    def latency(self) -> dict[str, float]:
        p99s = [m.latency.p99() for m in self.monitors.values() if isinstance(m, FateMonitor)]
        return {"max_p99_s": max(p99s, default=0.0)}


def main() -> None:
    port, first, count, total, protocol = sys.argv[1:6]
    nodes = Nodes(int(port), int(first), int(count), int(total), protocol)
    say({"ready": True})
    for line in sys.stdin:
        command, *args = line.split()
        if command == "start":
            nodes.start(int(args[0]))
            say({"started": True})
        elif command == "count":
            say(
                {
                    "calls": nodes.calls[0],
                    "time": time.monotonic(),
                    "learned": len(nodes.learned),
                    **nodes.latency(),
                }
            )
        elif command == "kill":
            base = int(args[0])
            killed = time.monotonic()
            nodes.kill(base)
            nodes.learned.pop(base, None)
            say({"killed": killed})
        elif command == "publish":
            say({"published": nodes.publish(int(args[0]))})
        elif command == "report":
            say({"learned": [[b, *v] for b, v in sorted(nodes.learned.items())]})
        elif command == "stop":
            nodes.stop()
            say({"stopped": True})
        elif command == "exit":
            nodes.stop()
            break


def say(answer: dict[str, Any]) -> None:
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        main()
