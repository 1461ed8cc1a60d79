"""What earlier attempts learned about a run's step and section times, kept in its output folder
(``hang_timeouts.json``) so that a restart or a requeue does not wait at the ceiling before its hang
timeouts are known again (``book.ProgressBook``).

Runs in the launcher (and OTX's caller). A file that cannot be read is an empty record,
one that cannot be written costs the reuse, never the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

LEARNED_FILE = "hang_timeouts.json"


@dataclass
class Learned:
    """The slowest step interval and section times seen, kept across attempts in the output folder."""

    slowest_step: float | None = None
    sections: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None) -> Learned:
        try:
            data = json.loads(path.read_text()) if path is not None else {}
            step = data.get("slowest_step_s")
            sections = {str(k): float(v) for k, v in dict(data.get("sections_s", {})).items()}
            return cls(float(step) if step is not None else None, sections)
        except (OSError, ValueError, TypeError, AttributeError):
            return cls()

    def save(self, path: Path) -> None:
        data = {
            "slowest_step_s": self.slowest_step,
            "sections_s": self.sections,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError:  # a full disk costs the reuse after a restart, never the run
            with contextlib.suppress(OSError):
                tmp.unlink()

    def note_step(self, interval: float) -> bool:
        if self.slowest_step is None or interval > self.slowest_step:
            self.slowest_step = interval
            return True
        return False

    def note_section(self, name: str, seconds: float) -> bool:
        if seconds > self.sections.get(name, -1.0):
            self.sections[name] = seconds
            return True
        return False
