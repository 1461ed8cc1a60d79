"""Was a SIGKILLed rank killed by the kernel's OOM killer? Runs in the launcher, on the supervisor's loop.

A SIGKILL alone does not say who sent it: a user's ``kill -9``, a scheduler, or the kernel out of
memory. The kernel leaves two traces: the ``oom_kill`` counter of the memory cgroup the rank was in
(cgroup v1 ``memory.oom_control``, v2 ``memory.events``), read when the rank starts and again when it
dies, and its log line ``Killed process PID (...) ... anon-rss:NkB`` (``/dev/kmsg``, where this user
may read it). Either one names the OOM killer; the log line also gives the rank's resident memory at
that moment, and the cgroup its limit. Nothing here runs unless a rank died of SIGKILL, and nothing
here fails the caller: what cannot be read is simply not said.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KILLED = re.compile(r"Killed process (\d+) \([^)]*\)(.*)")
RSS_FIELD = re.compile(r"(anon|file|shmem)-rss:(\d+)kB")
UNLIMITED = 1 << 60
"""cgroup v1 writes 'no limit' as a number near 2**63."""


@dataclass(frozen=True)
class MemoryCgroup:
    """A process's memory cgroup: its folder and the hierarchy's version."""

    path: Path
    version: int

    @classmethod
    def of(cls, pid: int, root: Path = CGROUP_ROOT) -> MemoryCgroup | None:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):
                path = root / "memory" / rel.lstrip("/")
                return cls(path, 1) if path.is_dir() else None
        for line in lines:  # the unified hierarchy, where the memory controller is enabled
            if line.startswith("0::"):
                path = root / line[3:].lstrip("/")
                return cls(path, 2) if (path / "memory.events").exists() else None
        return None

    def oom_kills(self) -> int | None:
        """How many processes the OOM killer has killed in this cgroup (and, on v2, below it)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return None

    def limit(self) -> int | None:
        """The memory limit in bytes, None where there is none (or it cannot be read)."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        with contextlib.suppress(OSError, ValueError):
            text = (self.path / name).read_text().strip()
            value = None if text == "max" else int(text)
            return value if value is not None and value < UNLIMITED else None
        return None


def kernel_kill_rss(pid: int, kmsg: str = "/dev/kmsg") -> int | None:
    """The resident bytes the kernel logged when its OOM killer killed ``pid``; None where it logged
    no such line, or the log cannot be read. The log is read without waiting (``O_NONBLOCK``)."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found: int | None = None
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten while reading; go on with the next
                continue
            if not record:
                break
            match = KILLED.search(record)
            if match and int(match.group(1)) == pid:
                found = sum(int(kb) for _, kb in RSS_FIELD.findall(match.group(2))) * 1024
    finally:
        os.close(fd)
    return found


@dataclass
class OomWatch:
    """One rank's memory cgroup and its OOM-kill count when the rank started."""

    cgroup: MemoryCgroup | None
    kills_at_start: int | None

    @classmethod
    def start(cls, pid: int) -> OomWatch:
        cgroup = MemoryCgroup.of(pid)
        return cls(cgroup, cgroup.oom_kills() if cgroup is not None else None)

    def explain(self, pid: int) -> str | None:
        """For a rank that died of SIGKILL: what the kernel says, as the report words it, or None
        when nothing says it was the OOM killer."""
        rss = kernel_kill_rss(pid)
        counted = (
            self.cgroup is not None
            and self.kills_at_start is not None
            and (self.cgroup.oom_kills() or 0) > self.kills_at_start
        )
        if rss is None and not counted:
            return None
        limit = self.cgroup.limit() if self.cgroup is not None else None
        parts = [
            f"resident {size(rss)}" if rss is not None else None,
            f"a {size(limit)} limit" if limit is not None else None,
        ]
        detail = " of ".join(p for p in parts if p) if all(parts) else ", ".join(p for p in parts if p)
        return f"the kernel's OOM killer{f' ({detail})' if detail else ''}"


def size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"
