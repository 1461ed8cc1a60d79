"""A real two-node SLURM cluster on loopback for the SLURM tests; runs in the pytest (xdist worker) process.

Why: every SLURM claim (layout, preemption signals, ``scontrol requeue``, lost nodes) was tested against
recorded environments and a stand-in ``scontrol``; this starts the real daemons instead. One ``munged``,
one ``slurmctld`` and two ``slurmd -N n1`` / ``-N n2`` run in the foreground as children of this
process, each with its own port, state, spool, pid and log file in one temporary folder, from a
``slurm.conf`` written there (``SLURM_CONF`` points every daemon and client at it), so a developer's
machine keeps its own SLURM and munge untouched. ``stop()`` ends each daemon by its Popen handle and
proves it gone. Node names must resolve: ``ensure_hosts`` adds one ``/etc/hosts`` line when missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

NODES = ("n1", "n2")
SBIN = ("/usr/sbin", "/usr/bin")
HOSTS_LINE = "127.0.0.1 n1 n2  # added by multigpu's SLURM test tier\n"
START_TIMEOUT_S = 30.0
KILL_WAIT_S = 2

CONF = """\
ClusterName=mgtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
TmpFS={root}/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait={kill_wait}
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
NodeName=n1 NodeAddr=127.0.0.1 Port={port_n1} CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port={port_n2} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why the tier cannot run here (None when it can): the daemons or the clients are not installed."""
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo"):
        if shutil.which(tool) is None and not any(os.access(f"{d}/{tool}", os.X_OK) for d in SBIN):
            return f"SLURM tier: {tool} is not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "SLURM tier: the test cluster's daemons run as SlurmUser=root and need root"
    return None


def _tool(name: str) -> str:
    found = shutil.which(name)
    return found if found else next(f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK))


def _port() -> int:
    """A free loopback port for a daemon (the daemons bind it themselves: probe-then-use is all we have)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_hosts() -> str | None:
    """Map n1 and n2 to 127.0.0.1 in /etc/hosts when they do not resolve; the one line saying so, or None."""
    try:
        if all(socket.gethostbyname(n) == "127.0.0.1" for n in NODES):
            return None
    except OSError:
        pass
    with open("/etc/hosts", "a") as f:
        f.write(HOSTS_LINE)
    return f"SLURM tier: added '{HOSTS_LINE.strip()}' to /etc/hosts"


class SlurmCluster:
    """The daemons of one test run and the environment that points clients at them."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="mg-slurm-"))
        self.root.chmod(0o755)  # munged wants its socket reachable by everyone
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env: dict[str, str] = {}

    def start(self) -> None:
        """Write the config, start munged, slurmctld and both slurmd, and wait until both nodes are idle."""
        for sub in ("munge", "state", "spool/n1", "spool/n2", "run", "log", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ports = {k: _port() for k in ("ctld_port", "slurmd_port", "port_n1", "port_n2")}
        conf = self.root / "slurm.conf"
        conf.write_text(
            CONF.format(
                host=socket.gethostname().split(".")[0], root=self.root, kill_wait=KILL_WAIT_S, **ports
            )
        )
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        self._start_munge()
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-i", "-f", str(conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_tool("slurmd"), "-D", "-N", node, "-f", str(conf)])
        self.wait_idle()

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn(
            "munged",
            [
                _tool("munged"),
                "-F",
                "-f",
                f"--socket={munge}/munge.socket",
                f"--key-file={key}",
                f"--log-file={munge}/munged.log",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
            ],
        )
        self._wait(lambda: (munge / "munge.socket").exists(), "munged never made its socket")

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            self.procs[name] = subprocess.Popen(
                argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _wait(self, ready: object, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(ready) and ready():
                return
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{what}: {dead} exited; logs in {self.root / 'log'}\n{self.logs()}")
            time.sleep(0.1)
        raise RuntimeError(f"{what} within {timeout:.0f}s; logs in {self.root / 'log'}\n{self.logs()}")

    def wait_idle(self) -> None:
        """Wait (bounded) until ``sinfo`` shows both nodes idle."""

        def idle() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            return sorted(zip(out[::2], out[1::2], strict=False)) == [(n, "idle") for n in NODES]

        self._wait(idle, "sinfo never showed n1 and n2 idle")

    def run(
        self,
        argv: list[str],
        check: bool = True,
        timeout: float = 30,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster, bounded in time."""
        return subprocess.run(
            argv,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            cwd=cwd,
        )

    def logs(self) -> str:
        tails = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(tails)

    def job_processes(self) -> list[psutil.Process]:
        """Every live process of this cluster's jobs, on either node: job steps (slurmstepd, which
        re-parents itself to init), launchers, ranks. Found by the ``SLURM_CONF`` they carry."""
        conf, daemons, found = self.env.get("SLURM_CONF"), {p.pid for p in self.procs.values()}, []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.pid in daemons or proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if proc.environ().get("SLURM_CONF") == conf:
                    found.append(proc)
        return found

    def end_jobs(self, timeout: float = 15) -> list[int]:
        """Cancel every job still in this cluster and wait (bounded) for its processes to end; SIGKILL
        what outlives that, by PID. Stopping slurmd ends no job step: without this a job left running
        by a failed test would outlive the cluster. Returns the PIDs that had to be killed."""
        self.run(["scancel", "--user", "root"], check=False)
        deadline = time.monotonic() + timeout
        left = self.job_processes()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.job_processes()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return [proc.pid for proc in left]

    def stop(self) -> list[str]:
        """SIGTERM every daemon (slurmd first, munged last), SIGKILL what outlives 10 s; names still alive."""
        left = []
        for name in [*sorted(n for n in self.procs if n.startswith("slurmd")), "slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, 0)
                left.append(name)
        return left

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    cluster = SlurmCluster()
    t0 = time.monotonic()
    try:
        cluster.start()
        print(f"up in {time.monotonic() - t0:.1f}s", cluster.run(["sinfo"]).stdout)
        print(cluster.run(["srun", "-N2", "--ntasks-per-node=1", "hostname"], check=False))
    finally:
        print("left:", cluster.stop())
        print(cluster.logs())
