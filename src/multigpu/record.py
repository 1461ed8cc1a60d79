"""The run record, ``<output>/run.json``: written atomically and kept current as states change."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import RunConfig
from .errors import signal_name
from .supervisor import RunResult, Worker


def atomic_write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _config_dict(config: RunConfig) -> dict[str, Any]:
    data = asdict(config)
    data["log_ranks"] = sorted(config.log_ranks) if config.log_ranks is not None else None
    data["rdzv_endpoint"] = str(config.rdzv_endpoint) if config.rdzv_endpoint else None
    data.pop("extra_env", None)
    return data


class RunRecord:
    """Listens to the supervisor and rewrites run.json on every state change."""

    def __init__(self, path: Path, config: RunConfig, run_id: str, devices: list[str],
                 command: list[str] | None = None) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "run_id": run_id,
            "command": command if command is not None else ["multigpu", *sys.argv[1:]],
            "config": _config_dict(config),
            "devices": devices,
            "status": "starting",
            "start_time": time.time(),
            "end_time": None,
            "exit_code": None,
            "attempts": [],
        }
        self.write()

    def begin_attempt(self, attempt: int, master_addr: str, master_port: int) -> None:
        self.data["status"] = "running"
        self.data["attempts"].append({"attempt": attempt, "master_addr": master_addr,
                                      "master_port": master_port, "status": "running", "ranks": {},
                                      "root_cause": None, "failures": []})
        self.write()

    def on_worker_change(self, worker: Worker) -> None:
        rc = worker.returncode
        self.data["attempts"][-1]["ranks"][str(worker.rank)] = {
            "rank": worker.rank,
            "local_rank": worker.spec.local_rank,
            "node": worker.spec.node,
            "pid": worker.pid,
            "device": worker.spec.device,
            "state": worker.state.value,
            "start_time": worker.start_time,
            "end_time": worker.end_time,
            "exit_code": rc if rc is not None and rc >= 0 else None,
            "signal": signal_name(-rc) if rc is not None and rc < 0 else None,
            "log": str(worker.spec.log_path) if worker.spec.log_path else None,
        }
        self.write()

    def end_attempt(self, result: RunResult) -> None:
        attempt = self.data["attempts"][-1]
        attempt["status"] = result.status.value
        attempt["failures"] = [f.to_dict() for f in result.failures]
        attempt["root_cause"] = result.root_cause.to_dict() if result.root_cause else None
        self.write()

    def finish(self, status: str, exit_code: int) -> None:
        self.data.update(status=status, exit_code=exit_code, end_time=time.time())
        self.write()

    def write(self) -> None:
        atomic_write_json(self.path, self.data)
