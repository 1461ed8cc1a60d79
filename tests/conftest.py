"""Hygiene for every test: no leaked processes, threads, descriptors or environment variables.

Tests that start launchers also prove, by PID, that everything the launcher started is gone
(``helpers.assert_gone``); this fixture catches whatever a test forgot, and ends it by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import multigpu.console.log  # noqa: F401 - the ``multigpu`` logger at INFO, as in every launcher
from helpers import alive, record_problems


def pytest_configure(config: pytest.Config) -> None:
    """Start every test's processes with the signal dispositions a user's terminal gives them.

    A suite started in the background by a script (``cmd &`` without job control) inherits SIGINT and
    SIGQUIT ignored, and under ``nohup`` SIGHUP too; every process a test starts would inherit that,
    and a shell cannot even trap a signal ignored at its start. Tests that need a signal ignored
    (``nohup`` semantics) set it themselves. Runs in pytest's process and in each xdist worker.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    # Function launches keep their records under the user's cache folder (function/run_history.py):
    # the suite's go to a folder of its own, never the real ~/.cache, and are removed at the end.
    cache = tempfile.mkdtemp(prefix="test-cache-")
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    os.environ["XDG_CACHE_HOME"] = cache


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    before_procs = _descendants()
    before_threads = set(threading.enumerate())
    before_fds = _fds()
    before_env = _env()
    yield
    problems = []
    deadline = time.monotonic() + 2.0
    leaked: set[int] = set()
    while time.monotonic() < deadline:
        leaked = {pid for pid in _descendants() - before_procs if alive(pid)}
        if not leaked:
            break
        time.sleep(0.05)
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    if leaked:
        problems.append(f"leaked processes {sorted(leaked)}")
    deadline = time.monotonic() + 2.0
    extra_threads: list[threading.Thread] = []
    while time.monotonic() < deadline:
        extra_threads = [t for t in threading.enumerate() if t not in before_threads and t.is_alive()]
        if not extra_threads:
            break
        time.sleep(0.02)
    if extra_threads:
        problems.append(f"leaked threads {[t.name for t in extra_threads]}")
    leaked_fds = _fds() - before_fds
    # Descriptors may be closed lazily by garbage collection; give it one chance.
    if leaked_fds:
        import gc

        gc.collect()
        leaked_fds = {fd for fd in _fds() - before_fds if os.path.exists(f"/proc/self/fd/{fd}")}
    if leaked_fds:
        targets = []
        for fd in sorted(leaked_fds):
            with contextlib.suppress(OSError):
                targets.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        if targets:
            problems.append(f"leaked descriptors {targets}")
    if _env() != before_env:
        changed = sorted(set(_env().items()) ^ set(before_env.items()))
        for key in set(os.environ) - set(before_env) - {"PYTEST_CURRENT_TEST"}:
            del os.environ[key]
        os.environ.update(before_env)
        problems.append(f"changed environment {changed[:5]}")
    if problems:
        pytest.fail("test hygiene: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that shows no GPU, whatever this one has: discovery (NVML, then ``/proc``) finds none
    and no ``CUDA_VISIBLE_DEVICES`` is set. Runs in the test's process; a test that needs GPUs fakes
    them after this (``monkeypatch.setattr(devices, "_nvml_gpus", ...)``)."""
    from multigpu.cluster import devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: None)
    monkeypatch.setattr(devices, "_proc_gpus", lambda root=devices.PROC_GPUS: [])


@pytest.fixture(autouse=True)
def run_records_follow_the_schema(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every run record a test's launcher wrote under its ``tmp_path`` is valid against
    ``schemas/run.schema.json`` (issue 22: the record must agree with itself and with its schema)."""
    root: Path | None = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if root is None:
        return
    problems = record_problems(root)
    if problems:
        pytest.fail("run records against schemas/run.schema.json: " + "; ".join(problems[:5]), pytrace=False)
