"""The format of torch's flight-record dump, read without torch and without trusting the file.

A dump is a pickled dict of dicts, lists, strings and numbers (see ``supervisor/hangs/flight_record.py``); the
loader refuses every class, so a dump cannot run code in whoever reads it. Written by the rank
(``rank/dump_signal.py``), read by the launcher. Standard library only.
"""

from __future__ import annotations

import io
import pickle
from typing import Any


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight-recorder dump holds no classes ({module}.{name})")


def load_dump(raw: bytes) -> dict[str, Any]:
    data = _PlainUnpickler(io.BytesIO(raw)).load()
    if not isinstance(data, dict):
        raise ValueError("not a flight-recorder dump")
    return data
