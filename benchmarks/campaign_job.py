"""One elastic job on the namespace cluster for the fault campaign (issue 41), run in the harness
process: the store host S and four training hosts A-D (``tests/netns_cluster.py``), their launchers
(multigpu with ``multigpu store`` on S, or torchrun with its c10d store on A, as torchrun users run
it), the ranks' step logs, and every line the launchers print, stamped with the wall time it arrived.

The training script checkpoints its step each ``CKPT_EVERY`` steps (rank 0, to a shared file) and
resumes from it; it raises when a trigger file names its host (the software fault), and every rank
stops together once a stop file exists (the flag rides the step's all_reduce).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from campaign_stats import Step

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from netns_cluster import NetnsCluster, available  # noqa: E402

__all__ = ["NetnsCluster", "available"]

PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).parent / "torchrun")
HOSTS = ("A", "B", "C", "D")
PORT = 29500
CKPT_EVERY = 10
MAX_RESTARTS = 50
TRAIN = """
    import os, time
    T0 = time.time()
    import torch, torch.distributed as dist
    try:
        from multigpu import heartbeat
    except ImportError:  # torchrun users without multigpu
        def heartbeat(step=None): pass
    folder, host = os.environ["CAMPAIGN_DIR"], os.environ["CAMPAIGN_HOST"]
    ckpt, trigger, stop = (os.path.join(folder, n) for n in ("ckpt", f"raise_{host}", "stop"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    log = open(os.path.join(folder, f"steps_{host}.txt"), "a")
    log.write(f"{T0:.3f} {host} start pid={os.getpid()} from={step}\\n")
    log.flush()
    last = int(os.environ.get("MAX_STEPS", "1000000000"))
    while step < last:
        if os.path.exists(trigger):
            os.unlink(trigger)
            raise RuntimeError(f"injected software fault at step {step}")
        flag = torch.tensor([float(os.path.exists(stop))])
        dist.all_reduce(flag)  # the step's collective; every rank sees the stop flag at once
        if flag.item() > 0:
            break
        log.write(f"{time.time():.3f} {host} step={step} world={world} pid={os.getpid()}\\n")
        log.flush()
        heartbeat(step=step)
        step += 1
        if rank == 0 and step % int(os.environ["CKPT_EVERY"]) == 0:
            with open(ckpt + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(ckpt + ".tmp", ckpt)
        time.sleep(0.05)
    dist.destroy_process_group()
"""
STEP = re.compile(r"^([\d.]+) (\w+) step=(\d+) world=(\d+) pid=(\d+)$", re.M)
START = re.compile(r"^([\d.]+) (\w+) start pid=(\d+) from=(\d+)$", re.M)


def write_train(folder: Path) -> Path:
    path = folder / "train.py"
    path.write_text(textwrap.dedent(TRAIN))
    return path


def env_for(folder: Path, host: str, dev: str) -> dict[str, str]:
    """The harness's environment without any launcher's contract, plus the script's settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MULTIGPU_", "TORCHELASTIC_", "SLURM_", "PET_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        CAMPAIGN_DIR=str(folder), CAMPAIGN_HOST=host, CKPT_EVERY=str(CKPT_EVERY), GLOO_SOCKET_IFNAME=dev,
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RES_OPTIONS="timeout:1 attempts:1",
    )  # fmt: skip
    return env


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has finished)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Stamper(threading.Thread):
    """Reads the launchers' output files every 20 ms and keeps each new line with its arrival time."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.files: dict[str, Path] = {}
        self.lines: list[tuple[float, str, str]] = []
        self._offsets: dict[str, int] = {}
        self._halt = threading.Event()

    def watch(self, name: str, path: Path) -> None:
        self.files[name] = path

    def run(self) -> None:
        while not self._halt.wait(0.02):
            self.poll()

    def poll(self) -> None:
        for name, path in list(self.files.items()):
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = f.read()
                cut = data.rfind(b"\n") + 1
                self._offsets[name] = self._offsets.get(name, 0) + cut
                now = time.time()
                self.lines += [(now, name, ln) for ln in data[:cut].decode(errors="replace").splitlines()]

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.poll()


class Job:
    """The launchers of one job (``kind``: multigpu or torchrun), one per training host, restartable
    per host (a repaired node) or whole (torchrun after a fault it never recovered from)."""

    def __init__(self, net: NetnsCluster, folder: Path, kind: str, stamper: Stamper) -> None:
        self.net, self.folder, self.kind, self.stamper = net, folder, kind, stamper
        self.script = write_train(folder)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.generation = 0
        self.starts = 0

    def argv(self, host: str) -> list[str]:
        common = ["--nnodes", "3:4", "--rdzv-backend", "c10d", "--max-restarts", str(MAX_RESTARTS)]
        if self.kind == "torchrun":
            # A hosts the store: on a real cluster torchrun sees that A's hostname is the endpoint's,
            # and every node's hostname resolves to its address; in a namespace every host has the
            # machine's hostname, so A is told (is_host=true) and each its address (--local-addr)
            endpoint = f"{self.net.hosts['A'].addr}:{PORT + self.generation}"
            conf = f"is_host={str(host == 'A').lower()},last_call_timeout=1"
            return [
                TORCHRUN, *common, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                "--local-addr", self.net.hosts[host].addr,
                "--rdzv-id", f"camp{self.generation}", "--rdzv-conf", conf, str(self.script),
            ]  # fmt: skip
        return [
            PYTHON, "-m", "multigpu", "run", "--cpu", "1", *common, "--rdzv-endpoint",
            f"{self.net.hosts['S'].addr}:{PORT}", "--rdzv-id", "camp", "--rdzv-conf",
            "is_host=false,last_call_timeout=1", "--hang-timeout", "5", "--hang-floor", "2",
            "--grace-period", "1", "--status", "off", "--output",
            str(self.folder / f"out_{host}{self.starts}"), str(self.script),
        ]  # fmt: skip

    def start_store(self) -> None:
        if self.kind == "multigpu":
            argv = [PYTHON, "-m", "multigpu", "store", f"{self.net.hosts['S'].addr}:{PORT}"]
            self.net.start("S", argv, self.folder / "S", env_for(self.folder, "S", self.net.hosts["S"].dev))
            self.stamper.watch("S", self.folder / "S.err")

    def start(self, host: str) -> None:
        """``host``'s launcher (again): its output in <host><n>.out/.err, watched."""
        self.starts += 1
        log = self.folder / f"{host}{self.starts}"
        env = env_for(self.folder, host, self.net.hosts[host].dev)
        self.procs[host] = self.net.start(host, self.argv(host), log, env)
        for ext in ("out", "err"):
            self.stamper.watch(f"{host}{self.starts}.{ext}", Path(f"{log}.{ext}"))

    def start_all(self) -> None:
        for host in HOSTS:
            self.start(host)
            if self.kind == "torchrun" and host == "A":
                time.sleep(1.0)  # A hosts torchrun's store: first, as its users start it

    def steps(self) -> list[Step]:
        out: list[Step] = []
        for host in HOSTS:
            path = self.folder / f"steps_{host}.txt"
            text = path.read_text() if path.exists() else ""
            out += [Step(float(t), h, int(s), int(w), int(p)) for t, h, s, w, p in STEP.findall(text)]
        return sorted(out, key=lambda s: s.t)

    def starts_after(self, t: float) -> list[float]:
        """When a rank started (its script's first line) after ``t``."""
        text = "".join(
            (self.folder / f"steps_{h}.txt").read_text()
            for h in HOSTS
            if (self.folder / f"steps_{h}.txt").exists()
        )
        return sorted(float(m[0]) for m in START.findall(text) if float(m[0]) > t)

    def rank_pid(self, host: str) -> int:
        return [s.pid for s in self.steps() if s.host == host][-1]

    def end_all(self, bound: float) -> dict[str, int | None]:
        """SIGTERM every launcher still running, then wait up to ``bound``; their exit codes (None:
        killed after the bound)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for host, proc in self.procs.items():
            try:
                codes[host] = proc.wait(bound)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[host] = None
        self.generation += 1
        return codes


def sweep(net: NetnsCluster, hosts: tuple[str, ...] | list[str]) -> list[int]:
    """SIGKILL whatever still runs in ``hosts``' namespaces; the PIDs it had to end."""
    found = [pid for name, pids in net.running().items() if name in hosts for pid in pids]
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found
