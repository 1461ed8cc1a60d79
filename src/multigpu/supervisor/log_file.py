"""One log file of a worker that keeps working when the disk does not: a failed write is counted and
said once, never raised. Runs in the launcher, written by the output path (``output.WorkerOutput``)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import IO

from multigpu.contract.files import create_file

logger = logging.getLogger(__name__)


class LogFile:
    """One log file that keeps working when the disk does not: a failed write is counted, not raised."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lost = 0
        self.error: str | None = None
        self._file: IO[bytes] | None = None
        try:  # folders made without following another user's link; a planted link replaced, a FIFO refused
            self._file = os.fdopen(create_file(path), "wb", buffering=0)
        except OSError as exc:
            self._fail(exc)

    def write(self, data: bytes) -> None:
        if self._file is not None and self.error is None:
            try:
                written = self._file.write(data) or 0
            except OSError as exc:
                written = 0
                self._fail(exc)
            if written == len(data):
                return
            data = data[written:]
            if self.error is None:
                self._fail(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        self.lost += len(data)

    def _fail(self, exc: OSError) -> None:
        self.error = exc.strerror or str(exc)
        logger.warning(
            f"cannot write {self.path}: {self.error}; the rest of its output is lost (the run goes on)"
        )

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                if self.error is None:
                    self._fail(exc)
            self._file = None

    def loss(self) -> str | None:
        """One line for the run record, or None when the file is complete."""
        if self.error is None:
            return None
        return f"{self.path}: {self.error}; {self.lost} byte(s) not written"
