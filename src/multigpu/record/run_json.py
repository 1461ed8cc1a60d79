"""The run record, ``<output>/run.json``: written atomically and kept current as states change.

It always ends true: ``succeeded``, ``failed`` or ``interrupted`` (with the signal), and the exit
code, whatever ended the run. A full disk does not stop the run: when the atomic write (a temporary
file, then a rename) finds no space, the record is rewritten in place, compactly, when it fits in the
blocks it already has; when it does not, the console says once that run.json is stale, and
``output_lost`` lists the log files that could not be written in full.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from multigpu.config.run import RunConfig
from multigpu.contract.errors import UsageError
from multigpu.contract.files import open_existing, temporary_beside
from multigpu.contract.signals import signal_name
from multigpu.record import incidents
from multigpu.record.failure_report import rank_reason
from multigpu.record.ledger import Ledger
from multigpu.supervisor.states import RunResult, RunStatus, Worker

logger = logging.getLogger(__name__)


def atomic_write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, default=str) + "\n"
    tmp: Path | None = None
    try:
        fd, tmp = temporary_beside(path)  # mkstemp's name: nobody can plant a link there beforehand
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if not path.exists():
            raise
        compact = json.dumps(data, separators=(",", ":"), default=str) + "\n"
        if len(compact.encode()) > path.stat().st_blocks * 512:
            raise  # it would not fit in the blocks it has: cut short, it would no longer be JSON
        # no room for a second copy: overwrite the blocks it has, compactly (never through a link)
        with os.fdopen(open_existing(path, os.O_RDWR), "r+") as f:
            f.write(compact)
            f.truncate()


def with_utc_times(data: Any) -> Any:
    """``data`` with an ISO-8601 UTC twin beside every epoch time (``start_time`` ->
    ``start_time_utc``, ``time`` -> ``time_utc``): a reader need not convert, a program keeps the float."""
    if isinstance(data, list):
        return [with_utc_times(item) for item in data]
    if not isinstance(data, dict):
        return data
    out: dict[str, Any] = {}
    for key, value in data.items():
        out[key] = with_utc_times(value)
        if (
            (key == "time" or key.endswith("_time"))
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ):
            stamp = datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
            out[f"{key}_utc"] = stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return out


def _config_dict(config: RunConfig) -> dict[str, Any]:
    """The configuration, grouped as ``RunConfig`` is, in JSON's types."""
    data = asdict(config)
    out = config.output
    data["output"].update(
        log_ranks=sorted(out.log_ranks) if out.log_ranks is not None else None,
        local_ranks_filter=sorted(out.local_ranks_filter) if out.local_ranks_filter is not None else None,
        redirects=out.redirects.text,
        tee=out.tee.text,
    )
    data["rdzv"]["endpoint"] = str(config.rdzv.endpoint) if config.rdzv.endpoint else None
    data.pop("extra_env", None)
    return data


def complete_error_files(workers: list[Worker]) -> None:
    """Rewrite each ``error_rank_<r>.json`` a rank wrote with what only the launcher knows once it has
    ended: its exit code or signal, its log's path and last lines. Runs in the launcher, at the end of
    an attempt; the rank wrote its file before it exited, so those fields were empty there."""
    for w in workers:
        path = w.spec.error_file
        if w.ending.failure is not None and path is not None and w.own_record() is not None:
            with contextlib.suppress(OSError):
                w.ending.failure.write(path)


RunEnd = Literal["succeeded", "failed", "interrupted", "preempted"]
"""How a run ends, as its launcher finishes the record (``RunRecord.finish``)."""


class RunRecord:
    """Listens to the supervisor and rewrites run.json on every state change."""

    def __init__(
        self,
        path: Path,
        config: RunConfig,
        run_id: str,
        devices: list[str],
        command: list[str] | None = None,
    ) -> None:
        self.path = path
        resolved = _config_dict(config)  # what the run uses, not only what was given
        resolved["output"].update(dir=str(path.parent), run_id=run_id)
        self.data: dict[str, Any] = {
            "run_id": run_id,
            "command": command if command is not None else ["multigpu", *sys.argv[1:]],
            "config": resolved,
            "devices": devices,
            "status": "starting",
            "start_time": time.time(),
            "end_time": None,
            "exit_code": None,
            "attempts": [],
            "incidents": [],
            "launcher": launcher_identity(),
        }
        self.ledger = Ledger(self.data["start_time"], total_steps=config.output.steps)
        """Where the run's time went (``ledger.py``), kept in run.json as ``ledger``."""
        self._write_error: str | None = None
        self._created = False
        self.stop_signal: int | None = None
        self.write()
        self._created = True

    @classmethod
    def create(
        cls,
        path: Path,
        config: RunConfig,
        run_id: str,
        devices: list[str],
    ) -> RunRecord:
        """A new record, or one line (exit 2) when its folder cannot take it: before any worker runs."""
        try:
            return cls(path, config, run_id, devices)
        except OSError as exc:
            raise UsageError(
                f"output folder {path.parent}: cannot write {path.name}: {exc.strerror or exc}"
            ) from None

    def begin_attempt(self, attempt: int, master_addr: str, master_port: int) -> None:
        now = time.time()
        incidents.next_attempt_began(self.data["incidents"], now)
        self.ledger.attempt_began(now)
        self.data["status"] = "running"
        self.data["config"]["rdzv"]["endpoint"] = f"{master_addr}:{master_port}"  # the port bound
        self.data["attempts"].append(
            {
                "attempt": attempt,
                "master_addr": master_addr,
                "master_port": master_port,
                "status": "running",
                "ranks": {},
                "root_cause": None,
                "failures": [],
            }
        )
        self.write()

    def on_workers_change(self, workers: Sequence[Worker]) -> None:
        """The ranks whose state changed in one turn of the supervisor's loop: one rewrite for all."""
        for worker in workers:
            self._note_worker(worker)
        self.write()

    def _note_worker(self, worker: Worker) -> None:
        exit_code, signame = worker.exit_status()
        self.data["attempts"][-1]["ranks"][str(worker.rank)] = {
            "rank": worker.rank,
            "local_rank": worker.spec.local_rank,
            "node": worker.spec.node,
            "pid": worker.pid,
            "device": worker.spec.device,
            "state": worker.state.value,
            "start_time": worker.start_time,
            "end_time": worker.end_time,
            "exit_code": exit_code,
            "signal": signame,
            "reason": rank_reason(worker),
            "log": str(worker.spec.log_path) if worker.spec.log_path else None,
        }
        ending = worker.ending
        if ending.late_death is not None:  # its script had finished: a warning, not a failure
            self.data["attempts"][-1]["ranks"][str(worker.rank)]["died_after_finishing"] = ending.late_death
        if ending.unkillable:
            self.data["attempts"][-1]["ranks"][str(worker.rank)]["survived_sigkill"] = True

    def on_progress(self, progress: dict[str, dict[str, Any]]) -> None:
        """Every rank's step times (``book.ProgressBook.snapshot``): last step, median and slowest
        step interval, section times, the hang timeout in force, a straggler warning."""
        if self.data["attempts"]:
            self.data["attempts"][-1]["progress"] = progress
            incidents.progress_seen(self.data["incidents"], progress)
            firsts = [t for p in progress.values() if (t := p.get("first_step_time")) is not None]
            if firsts:
                self.ledger.first_step(min(firsts))
            self.write()

    def end_attempt(self, result: RunResult) -> None:
        attempt = self.data["attempts"][-1]
        attempt["status"] = result.status.value
        if result.status is RunStatus.INTERRUPTED:
            self.stop_signal = result.signal
            attempt["signal"] = signal_name(result.signal) if result.signal else None
        attempt["failures"] = [f.to_dict() for f in result.failures]
        attempt["root_cause"] = result.root_cause.to_dict() if result.root_cause else None
        now = time.time()
        found = incidents.incident(attempt["attempt"], result, now)
        if found is not None:
            self.data["incidents"].append(found)
        self.ledger.attempt_ended(found, now)
        self.write()

    def note_preflight(self, entry: dict[str, Any]) -> None:
        """The nodes' preflight check (``runner/preflight.py``): every node's figures and the verdict."""
        self.data["preflight"] = entry
        self.write()

    def note_losses(self, losses: list[str]) -> None:
        if losses:
            self.data.setdefault("output_lost", []).extend(losses)

    def finish(self, status: RunEnd, exit_code: int) -> None:
        """The end record; a run whose last attempt was interrupted says so, with the signal."""
        attempts = self.data["attempts"]
        if attempts and attempts[-1]["status"] in ("running", "interrupted") and status != "succeeded":
            status = "interrupted" if attempts[-1]["status"] == "interrupted" else status
            if attempts[-1]["status"] == "running":
                attempts[-1]["status"] = status
        self.data.update(status=status, exit_code=exit_code, end_time=time.time())
        self.ledger.finish(self.data["end_time"], (self.data.get("preemption") or {}).get("time"))
        if self.stop_signal is not None:
            self.data["signal"] = signal_name(self.stop_signal)
        self.write()

    def write(self) -> None:
        self.data["ledger"] = self.ledger.summary()
        try:
            atomic_write_json(self.path, with_utc_times(self.data))
        except OSError as exc:
            if not self._created:
                raise  # the first write, before any worker: the caller turns it into one line
            if self._write_error is None:
                self._write_error = exc.strerror or str(exc)
                logger.warning(
                    f"cannot update {self.path}: {self._write_error}; it stays as last written "
                    f"until a write succeeds"
                )
            return
        self._write_error = None


# ---- is the launcher that writes a record still there? (read by ``multigpu status`` and ``report``) ----

LOST = "launcher lost"
"""The status a record gets when its launcher is gone without finishing it (``close_if_lost``)."""

SAME_START_S = 1.0
"""Two start times this close are one process: psutil derives them from the boot time, which a clock
step can move by a fraction of a second; a reused pid started well after the launcher it replaced."""


def boot_id() -> str | None:
    """This boot of this machine's kernel: a pid (and its start time) means nothing across a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def start_time_of(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds, from /proc through psutil), or None when no live
    process has that pid (a zombie has ended: only its reaping is left)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else float(process.create_time())
    except psutil.Error:
        return None


def launcher_identity() -> dict[str, Any]:
    """What tells this launcher apart from any later process: its pid, the pid's start time (a reused
    pid has another), the host and the boot it runs in, and its user. Runs in the launcher."""
    started = start_time_of(os.getpid())
    return {
        "pid": os.getpid(),
        "start_time": started if started is not None else time.time(),
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "uid": os.getuid(),
    }


@dataclass(frozen=True)
class LauncherFate:
    """What a reader can tell of a record's launcher: ``alive``, ``gone`` or ``unknown`` (another
    host or boot, or a record that names none), and the line that says so."""

    state: Literal["alive", "gone", "unknown"]
    line: str


def launcher_fate(
    data: dict[str, Any], host: str, boot: str | None, started: Callable[[int], float | None] = start_time_of
) -> LauncherFate:
    """Whether the launcher of an unfinished record is still running, judged from this host."""
    launcher = data.get("launcher")
    if not isinstance(launcher, dict):
        return LauncherFate(
            "unknown",
            "its run.json does not name its launcher (an older multigpu wrote "
            "it): cannot tell whether it is still running",
        )
    pid, where = launcher["pid"], launcher["host"]
    if where != host or launcher.get("boot_id") != boot:
        other = f"on {where}" if where != host else f"on {where} in an earlier boot"
        return LauncherFate(
            "unknown",
            f"its launcher (pid {pid}) runs {other}, and this is {host}: cannot "
            "tell whether it is still running; ask there",
        )
    now = started(pid)
    if now is None or abs(now - float(launcher["start_time"])) > SAME_START_S:
        return LauncherFate(
            "gone", f"{LOST}: pid {pid} on {where} is gone (its run.json still says {data.get('status')})"
        )
    return LauncherFate("alive", f"its launcher, pid {pid} on {where}, is running")


def read_fate(path: Path, data: dict[str, Any]) -> LauncherFate | None:
    """The launcher's fate for a record still open (None for one that ended); a record whose launcher is
    gone is closed as ``launcher lost`` when its own user reads it. Runs in the reader's shell."""
    if data.get("end_time") is not None:
        return None
    fate = launcher_fate(data, socket.gethostname(), boot_id())
    if fate.state == "gone":
        close_if_lost(path, data)
    return fate


def close_if_lost(path: Path, data: dict[str, Any]) -> bool:
    """End the record of a launcher that is gone, as ``launcher lost``, if this reader owns it (another
    user's reader only says so). The record keeps what the launcher last wrote (its ranks' states as
    they were then); ``end_time`` is when the loss was found."""
    try:
        if path.stat().st_uid != os.getuid():
            return False
        data.update(status=LOST, end_time=time.time(), exit_code=None)
        data["launcher"]["lost_found_time"] = data["end_time"]
        atomic_write_json(path, with_utc_times(data))
    except OSError:
        return False
    return True
