"""What each rank of ``multigpu.launch`` runs: the caller's function, its value or exception kept.

Runs in every rank that ``multigpu.launch`` (or ``multigpu.spawn``) starts, forked from the node's
template and past the ordinary rank bootstrap (``rank/bootstrap.run_function`` loads the payload, which
calls ``call_in_rank``). The function, its arguments and keyword arguments come as one cloudpickle blob:
a function from ``__main__`` or a notebook cell, or a lambda, travels by value; a module-level function
by reference. The return value is written to ``rank_<RANK>.pkl`` in the launch's results folder (CUDA
tensors moved to the CPU first, so the caller needs no GPU to read it); an exception is written to
``rank_<RANK>.error.pkl`` with its formatted traceback and pid, then raised again, so the bootstrap
records the failure and the launcher finds the root cause as for any run. A ``sys.exit`` is the rank's
exit, as in a script: ``sys.exit(0)`` (or ``sys.exit()``) is a rank that returned ``None``; any other code
is the rank's exit status, no exception to hand back (``multigpu.spawn`` raises torch's
``ProcessExitedException`` for it, ``multigpu.launch`` a ``WorkerFailedError`` naming rank and code).
Each rank writes its pid first (``rank_<RANK>.pid``): ``spawn(..., join=False)``'s ``pids()``.

Code objects travel with their file name and line numbers (cloudpickle would write ``<dynamic-code>``),
and a notebook cell's source lines with them, registered with ``linecache`` here: a rank's traceback
names the caller's script and line, or the cell as IPython names it.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import marshal
import os
import pickle
import traceback
import types
from collections import ChainMap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from multigpu.contract.frames import own_frame

RESULT_LIMIT_BYTES = 2**31
"""A return value larger than this (pickled) is refused in the rank, with an error naming it."""


def result_path(results: str | Path, rank: int) -> Path:
    return Path(results) / f"rank_{rank}.pkl"


def error_path(results: str | Path, rank: int) -> Path:
    return Path(results) / f"rank_{rank}.error.pkl"


def pid_path(results: str | Path, rank: int) -> Path:
    return Path(results) / f"rank_{rank}.pid"


def _code_reduce(code: types.CodeType) -> tuple[Callable[..., types.CodeType], tuple[Any, ...]]:
    """In the caller: a code object as ``marshal`` writes it, file name and line numbers kept (the rank
    runs the same interpreter, so marshal's version-bound format is safe), with the source lines of a
    file that is not on disk (a notebook cell, which IPython keeps in ``linecache``)."""
    filename = code.co_filename
    lines = None if os.path.isfile(filename) else linecache.getlines(filename) or None
    return load_code, (marshal.dumps(code), lines)


def load_code(data: bytes, lines: list[str] | None) -> types.CodeType:
    """In the rank: the code object back, its cell's lines registered so that tracebacks show them."""
    code = marshal.loads(data)
    if not isinstance(code, types.CodeType):
        raise TypeError(f"expected a code object, got {type(code).__name__}")
    if lines and code.co_filename not in linecache.cache:
        # mtime None: linecache.checkcache keeps the entry (no file to compare it with)
        linecache.cache[code.co_filename] = (sum(map(len, lines)), None, lines, code.co_filename)
    return code


class _CallPickler(cloudpickle.Pickler):  # type: ignore[misc,name-defined]
    """cloudpickle, with code objects that keep their file name (``_code_reduce``)."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps_call(call: Any) -> bytes:
    """In the caller: the function and its arguments, as the rank's ``call_in_rank`` loads them."""
    buffer = io.BytesIO()
    _CallPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(call)
    return buffer.getvalue()


class _CPUPickler(cloudpickle.Pickler):  # type: ignore[misc,name-defined]
    """cloudpickle, with every tensor that is not on the CPU pickled as its CPU copy."""

    def reducer_override(self, obj: Any) -> Any:
        torch = _torch_if_loaded()
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


def dumps_value(value: Any) -> bytes:
    buffer = io.BytesIO()
    _CPUPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _write(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def call_in_rank(blob: bytes, results: str) -> None:
    """Run the caller's function in this rank and keep what it returned, or what it raised."""
    rank = int(os.environ["RANK"])
    error_path(results, rank).unlink(missing_ok=True)  # an earlier attempt's (max_restarts): not this one's
    _write(pid_path(results, rank), str(os.getpid()).encode())
    fn, args, kwargs = pickle.loads(blob)
    try:
        value = _returned(fn, args, kwargs)
        data = dumps_value(value)
        if len(data) > RESULT_LIMIT_BYTES:
            raise ValueError(
                f"rank {rank}'s return value is {len(data)} bytes pickled, over "
                f"multigpu.launch's limit of {RESULT_LIMIT_BYTES} bytes; write it to a file "
                "and return the path"
            )
    except SystemExit:
        raise  # the rank's exit status, as a script's: no exception for the caller
    except BaseException as exc:
        _keep_exception(exc, error_path(results, rank))
        raise
    _write(result_path(results, rank), data)


def _returned(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn``'s value; ``None`` for a ``sys.exit(0)`` (or ``sys.exit()``): success, as under
    ``torch.multiprocessing.spawn``. Any other exit goes on as the rank's exit status."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None
        raise


def _keep_exception(exc: BaseException, path: Path) -> None:
    """The exception itself when it pickles (and unpickles), else only its text; always its traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and own_frame(tb.tb_frame):
        tb = tb.tb_next  # from the user's frame on (``call_in_rank``'s, ``spawn``'s are ours)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    record: dict[str, Any] = {"pid": os.getpid(), "traceback": text, "exception": None}
    with contextlib.suppress(Exception):
        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)  # one that cannot come back is sent as text only
        record["exception"] = pickled
    with contextlib.suppress(OSError):
        _write(path, pickle.dumps(record))
