"""A failed ``multigpu.launch`` as Python users expect it: the root-cause rank's own exception.

Runs in the caller, once the launcher has exited. The run's record (``run.json``) names the root cause;
when that rank raised, its exception (kept by ``rank_call``) is re-raised with its own type, the remote
traceback as ``__cause__`` (as ``concurrent.futures`` does) and a note naming the rank and pid. An
exception that cannot be unpickled here, or a rank that died without one (a signal, ``os._exit``), is
a ``WorkerFailedError``, as for ``MultiGPUManager``.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import Any

from multigpu.contract.errors import MultiGPUError, WorkerFailedError
from multigpu.contract.failure import WorkerFailure
from multigpu.function.rank_call import error_path


class RemoteTraceback(Exception):
    """An exception's traceback in a rank, as text (``concurrent.futures``' ``_RemoteTraceback``)."""

    def __init__(self, text: str, rank: int, pid: int | None) -> None:
        super().__init__(text)
        self.text, self.rank, self.pid = text, rank, pid
        """The traceback's text; the rank that raised it, and its pid."""

    def __str__(self) -> str:
        return f'\n"""\n{self.text}\n"""'


def last_attempt(output_dir: Path, run_id: str) -> dict[str, Any] | None:
    """The last attempt in run ``run_id``'s record, or None when there is no readable record of it (an
    earlier run's, or a live one's that refused this launch its folder, is not this launch's)."""
    try:
        data = json.loads((output_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("run_id") != run_id:
        return None
    attempts = data.get("attempts") or []
    return attempts[-1] if attempts else None


def failure_of(output_dir: Path, run_id: str, results: Path, code: int) -> BaseException:
    """What the caller raises for launch ``run_id`` (record in ``output_dir``, the ranks' exceptions in
    ``results``) whose launcher exited with ``code`` (not 0)."""
    attempt = last_attempt(output_dir, run_id)
    root = attempt.get("root_cause") if attempt else None
    if not root:
        return MultiGPUError(
            f"multigpu.launch failed (launcher exit code {code}) before any rank reported; "
            f"see the messages above and {output_dir}"
        )
    cause = WorkerFailure.from_dict(root)
    others = [WorkerFailure.from_dict(f) for f in (attempt or {}).get("failures", [])[1:]]
    raised = original_exception(error_path(results, cause.rank), cause.rank)
    return raised if raised is not None else WorkerFailedError(cause, others)


def original_exception(path: Path, rank: int) -> BaseException | None:
    """The rank's own exception, its remote traceback attached, or None when it cannot be had."""
    try:
        record = pickle.loads(path.read_bytes())
    except Exception:
        return None
    exc: BaseException | None = None
    with contextlib.suppress(Exception):
        exc = pickle.loads(record["exception"]) if record.get("exception") else None
    if not isinstance(exc, BaseException):
        return None
    text = str(record.get("traceback", "")).rstrip()
    exc.__cause__ = RemoteTraceback(text, rank, record.get("pid"))
    exc.add_note(f"multigpu: raised by rank {rank} (pid {record.get('pid')})")
    return exc
