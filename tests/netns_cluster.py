"""A cluster on a virtual network, for the heavy tier: a bridge in a namespace of its own and one
namespace per host on it, each with one link and its own address in 10.231.T.0/24 (T from the test
process's pid). Only these hosts are ever targets: nothing here routes beyond the bridge.

A host's link is a veth pair (the host's end in its namespace, the other on the bridge), or, for a host
created with a delay, a pair of TAP devices with a relay between them (this module run as a script, in
the bridge's namespace) that holds each frame the host sends for the delay: this kernel has no netem.
Loss is a classic-BPF filter on the host's egress that sends a random share of its frames to a link
that is down (``tc filter ... bpf ... action mirred``), where they are dropped. ``close`` removes
everything: the processes in the host namespaces (started by the test, or by what it started), the
relays, the filters and links (with their namespaces).

Runs in the test process (``NetnsCluster``) and, as ``python netns_cluster.py relay ...``, as a relay.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

RELAY = Path(__file__).resolve()
SKF_AD_RANDOM = 0xFFFFF000 + 56
"""classic BPF's ancillary load of a random 32-bit number (``ld rand``)."""


def available() -> str | None:
    """Why the cluster cannot be built here (root and iproute2 with tc needed), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if not any(Path(d, tool).exists() for d in ("/usr/sbin", "/sbin", "/usr/bin")):
            return f"network namespaces need iproute2 ({tool})"
    probe = f"mgprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "this machine refuses `ip netns add`"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*args: str) -> None:
    """One iproute2 command; its stderr is the error when it fails."""
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


def loss_bytecode(share: float) -> str:
    """A cBPF classifier that matches (so ``action drop`` drops) ``share`` of the frames at random."""
    below = min(0xFFFFFFFF, int(share * 2**32))
    program = [(0x20, 0, 0, SKF_AD_RANDOM), (0x25, 0, 1, below), (0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF)]
    return f"{len(program)}," + ",".join(f"{c} {jt} {jf} {k}" for c, jt, jf, k in program)


@dataclass
class Host:
    """One host of the cluster: its namespace, its link's name there and its address."""

    name: str
    ns: str
    dev: str
    addr: str
    relay: subprocess.Popen[bytes] | None = None


class NetnsCluster:
    """The bridge and its hosts (``hosts``: name -> Host); ``close`` undoes everything, safe twice."""

    def __init__(self, names: Sequence[str], delays: Mapping[str, float] | None = None) -> None:
        pid = os.getpid()
        self.tag = pid % 200 + 20
        self.bridge_ns = f"mgbr{pid}"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._lossy: set[str] = set()
        try:
            sh("ip", "netns", "add", self.bridge_ns)
            sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for index, name in enumerate(names):
                self._add_host(index, name, (delays or {}).get(name))
        except BaseException:
            self.close()
            raise

    def _add_host(self, index: int, name: str, delay: float | None) -> None:
        ns, near, far = f"mg{name.lower()}{os.getpid()}", f"n{name.lower()}{os.getpid()}"[:15], f"f{index}"
        host = Host(name, ns, near, f"10.231.{self.tag}.{10 + index}")
        self.hosts[name] = host
        sh("ip", "netns", "add", ns)
        if delay is None:
            sh("ip", "-n", self.bridge_ns, "link", "add", far, "type", "veth", "peer", "name", near)
        else:
            host.relay = self._relay(near, far, delay)
        sh("ip", "-n", self.bridge_ns, "link", "set", near, "netns", ns)
        sh("ip", "-n", self.bridge_ns, "link", "set", far, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{host.addr}/24", "dev", near)
        sh("ip", "-n", ns, "link", "set", near, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _relay(self, near: str, far: str, delay: float) -> subprocess.Popen[bytes]:
        """A relay between two TAP devices it creates in the bridge's namespace, holding ``near``'s
        frames for ``delay``; ready once it has said so (its devices exist)."""
        command = [sys.executable, str(RELAY), "relay", near, far, f"{delay}"]
        relay = subprocess.Popen(["ip", "netns", "exec", self.bridge_ns, *command], stdout=subprocess.PIPE)
        assert relay.stdout is not None
        if relay.stdout.readline().strip() != b"ready":
            relay.kill()
            relay.wait()
            raise RuntimeError("the TAP relay did not start")
        return relay

    def link(self, name: str, up: bool) -> None:
        """Take ``name``'s link down or up (as a cable pulled and plugged back)."""
        host = self.hosts[name]
        sh("ip", "-n", host.ns, "link", "set", host.dev, "up" if up else "down")

    def flap(self, name: str, down_s: float, up_s: float, times: int) -> float:
        """Down ``down_s``, up ``up_s``, ``times`` times; the monotonic time of the last return."""
        back = time.monotonic()
        for _ in range(times):
            self.link(name, up=False)
            time.sleep(down_s)
            self.link(name, up=True)
            back = time.monotonic()
            time.sleep(up_s)
        return back

    def lose(self, name: str, share: float) -> None:
        """Drop ``share`` (0..1) of the frames ``name`` sends, at random, until ``close``: a cBPF filter
        on its egress redirects them to a link that is down, where they are dropped (this kernel has
        ``mirred``, not ``gact``'s ``drop``)."""
        host = self.hosts[name]
        if name not in self._lossy:
            sh("ip", "-n", host.ns, "link", "add", "sink0", "type", "veth", "peer", "name", "sink1")
            sh("ip", "netns", "exec", host.ns, "tc", "qdisc", "add", "dev", host.dev, "clsact")
            self._lossy.add(name)
        sh(
            "ip", "netns", "exec", host.ns, "tc", "filter", "add", "dev", host.dev, "egress",
            "bpf", "bytecode", loss_bytecode(share), "action", "mirred", "egress", "redirect", "dev", "sink0",
        )  # fmt: skip

    def start(
        self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        """``argv`` on host ``name``, its stdout and stderr in ``log``.out and ``log``.err."""
        command = ["ip", "netns", "exec", self.hosts[name].ns, *argv]
        with open(f"{log}.out", "wb") as out, open(f"{log}.err", "wb") as err:
            proc = subprocess.Popen(command, env=dict(env), stdout=out, stderr=err)
        self.procs.append(proc)
        return proc

    def running(self) -> dict[str, list[int]]:
        """The processes alive in each host's namespace (whoever started them), by host name."""
        found: dict[str, list[int]] = {}
        for name, host in self.hosts.items():
            out = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True).stdout
            pids = [int(p) for p in out.split() if int(p) != os.getpid()]
            if pids:
                found[name] = pids
        return found

    def close(self) -> None:
        """Kill whatever runs in the hosts' namespaces and the relays, then delete the namespaces
        (their links and filters go with them)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for pids in self.running().values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.procs + [h.relay for h in self.hosts.values() if h.relay is not None]:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for ns in [h.ns for h in self.hosts.values()] + [self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.hosts.clear()
        self.procs.clear()


@contextlib.contextmanager
def cluster(names: Sequence[str], delays: Mapping[str, float] | None = None) -> Iterator[NetnsCluster]:
    """The cluster for the length of a ``with``, removed whatever happens inside."""
    built = NetnsCluster(names, delays)
    try:
        yield built
    finally:
        built.close()


TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000


def open_tap(name: str) -> int:
    """A new TAP device ``name`` in this process's namespace, and its descriptor (frames, no header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def relay(near: str, far: str, delay: float) -> None:
    """Frames read from ``near`` (the host's link) leave on ``far`` (the bridge's port) ``delay``
    later; the other way at once. A write to a device that is down fails: that frame is lost."""
    a, b = open_tap(near), open_tap(far)
    print("ready", flush=True)
    held: list[tuple[float, int, bytes]] = []
    count = 0
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([a, b], [], [], wait)
        if a in readable:
            count += 1
            heapq.heappush(held, (time.monotonic() + delay, count, os.read(a, 65536)))
        if b in readable:
            frame = os.read(b, 65536)
            with contextlib.suppress(OSError):
                os.write(a, frame)
        while held and held[0][0] <= time.monotonic():
            with contextlib.suppress(OSError):
                os.write(b, heapq.heappop(held)[2])


if __name__ == "__main__" and sys.argv[1:2] == ["relay"]:
    relay(sys.argv[2], sys.argv[3], float(sys.argv[4]))


# The job every namespace case runs (tests/integration/multinode/test_network*.py and
# benchmarks/network_cases.py): a gloo all_reduce loop logging each step with its world and restart.
TRAIN = """
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    with open(os.environ["STEPS_LOG"], "a") as log:
        for step in range(int(os.environ["STEPS"])):
            dist.all_reduce(t)
            log.write(f"{time.time():.3f} world={dist.get_world_size()} "
                      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} step={step} pid={os.getpid()}\\n")
            log.flush()
            time.sleep(0.05)
    dist.destroy_process_group()
"""
