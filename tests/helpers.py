"""Shared test helpers: real processes, bounded in time, checked by PID."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import pytest

PYTHON = sys.executable
MULTIGPU = [PYTHON, "-m", "multigpu"]


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie has finished; only its reaping is left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until every pid is gone; return the ones still alive at the deadline."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def assert_gone(pids: Iterable[int], timeout: float = 2.0) -> None:
    pids = list(pids)
    assert pids, "no PIDs to check: the test did not capture what it started"
    left = wait_gone(pids, timeout)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    assert not left, f"still alive after {timeout}s: {left}"


def write_script(directory: Path, name: str, code: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(code))
    return path


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any launcher or scheduler contract leaking in (a CI inside
    SLURM would otherwise turn preemption on in every test)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MULTIGPU_", "TORCHELASTIC_", "SLURM_", "PET_"))
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "CUDA_VISIBLE_DEVICES",
        )
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m multigpu ARGS`` to completion, bounded in time."""
    return subprocess.run(
        [*MULTIGPU, *args], cwd=cwd, env=clean_env(env), capture_output=True, text=True, timeout=timeout
    )


def start_cli(args: list[str], cwd: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*MULTIGPU, *args],
        cwd=cwd,
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Each process run to its end in turn, bounded: (exit code, stdout, stderr) each. Whatever a
    time-out or a failure leaves running is killed and reaped."""
    ended = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            ended.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return ended


def pids_in(text: str, label: str = "pid") -> list[int]:
    """PIDs a test worker printed as ``<label>=<n>``."""
    return [int(m) for m in re.findall(rf"\b{label}=(\d+)", text)]


def wait_for_lines(path: Path, pattern: str, count: int, timeout: float) -> list[str]:
    """Wait until ``path`` holds ``count`` lines matching ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            found = re.findall(pattern, path.read_text())
            if len(found) >= count:
                return found
        time.sleep(0.05)
    raise AssertionError(f"{path} never had {count} lines matching {pattern!r}")


def free_port() -> int:
    """A port for a test's fixed rendezvous endpoint, below the kernel's ephemeral range so that no
    outgoing connection (a gloo pair, a store client) can take it between this check and the bind."""
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(200):
        port = random.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def node_args(
    node: int | None,
    nnodes: int | str = 2,
    *,
    endpoint: str | None = None,
    master_port: int | str | None = None,
) -> list[str]:
    """The options that place one launcher in a job of several nodes on this machine, for a test's
    ``multigpu run`` line: ``--nnodes``, this launcher's ``--node-rank`` (None: an elastic node, whose
    round gives it one), and where the nodes meet: ``endpoint`` (``--rdzv-endpoint HOST:PORT``) or
    torchrun's ``--master-addr 127.0.0.1 --master-port PORT``. An elastic ``nnodes`` (``MIN:MAX``)
    meets through ``--rdzv-backend c10d``, the one backend for it."""
    args = ["--nnodes", str(nnodes)]
    if node is not None:
        args += ["--node-rank", str(node)]
    if ":" in str(nnodes):
        args += ["--rdzv-backend", "c10d"]
    if endpoint is not None:
        args += ["--rdzv-endpoint", endpoint]
    if master_port is not None:
        args += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    return args


def supervisor_arguments(**kwargs: Any) -> dict[str, Any]:
    """``Supervisor``'s keyword arguments from flat ones (``grace_period=``, ``tick=``...)."""
    from multigpu.supervisor.settings import Hooks, SupervisorOptions

    option_names = {f.name for f in dataclasses.fields(SupervisorOptions)}
    hook_names = {f.name for f in dataclasses.fields(Hooks)}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names}
    hooks = {k: kwargs.pop(k) for k in list(kwargs) if k in hook_names}
    return {"options": SupervisorOptions(**options), "hooks": Hooks(**hooks), **kwargs}


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The launcher's own lines that the code under test logged (``console/log.py``), in order: what a
    run's console would show after ``multigpu: ``."""
    return [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "multigpu"]


NUMPY_SITE = Path(os.environ.get("MULTIGPU_TEST_NUMPY_SITE", "/tmp/multigpu-test-numpy"))
"""A folder holding NumPy alone, put on ``PYTHONPATH`` for the runs a test makes "with NumPy installed"
(the dev venv has none: torch's CPU wheel runs without it). Made once per machine by pip."""


def numpy_site() -> Path | None:
    """``NUMPY_SITE``, made on first use (under a lock: xdist workers race for it) by the benchmarks'
    own maker; None where pip cannot install NumPy here (no registry), and the caller skips in one line."""
    from benchmarks.common import numpy_site as made
    from filelock import FileLock  # torch's own dependency

    NUMPY_SITE.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{NUMPY_SITE}.lock", timeout=300):
        return made(NUMPY_SITE)


def in_ci() -> bool:
    """``CI=true`` (or 1/yes): the suite runs as CI, where a tier that cannot run is a failure."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def tier_cannot_run(reason: str) -> NoReturn:
    """A tier whose dependency is missing here (SLURM, Chromium, the memory cgroup, root): locally it
    skips with ``reason`` in one line; under ``CI=true`` it fails with the same reason, so that CI cannot
    go green by skipping what it exists to run."""
    import pytest

    if in_ci():
        pytest.fail(f"CI=true, and this tier cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory folder, where one is mounted and readable."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):
                path = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
                return path if (path / "memory.limit_in_bytes").exists() else None
    return None


@contextlib.contextmanager
def memory_cgroup(limit: str) -> Iterator[Path]:
    """A child memory cgroup of this process's own with ``limit`` (and no swapping out of it); the
    test skips in one line (fails under CI=true) where the machine does not let this process make one.
    Removed after: every process in it is gone by then (the test proves it)."""
    import uuid

    parent = own_memory_cgroup()
    if parent is None:
        tier_cannot_run("no cgroup v1 memory controller for this process")
    path = parent / f"multigpu-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(limit)
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        tier_cannot_run(f"cannot make a child memory cgroup here: {exc.strerror}")
    with contextlib.suppress(OSError):  # where swap is accounted, no swapping out of the OOM either
        (path / "memory.memsw.limit_in_bytes").write_text(limit)
    try:
        yield path
    finally:
        path.rmdir()


SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "run.schema.json"
_RECORD_NAME = re.compile(r"run(_node\d+|_[^/]+)?\.json")


def _validator() -> Any:
    import jsonschema  # the dev extra's; only the record check needs it

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def record_problems(root: Path) -> list[str]:
    """What is wrong with the run records under ``root``: each one that cannot be read or parsed (the
    launcher replaces its record whole, by rename, so that is a defect, not a race), and each place one
    breaks ``schemas/run.schema.json``. JSON files under those names that are not records are skipped."""
    problems: list[str] = []
    for path in sorted(root.rglob("run*.json")):
        if not _RECORD_NAME.fullmatch(path.name):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{path.relative_to(root)}: unreadable: {err}")
            continue
        if isinstance(data, dict) and "attempts" in data:
            problems += [
                f"{path.relative_to(root)}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in _validator().iter_errors(data)
            ]
    return problems


CGROUP_V1 = Path("/sys/fs/cgroup")


@contextlib.contextmanager
def v1_group(controller: str, **settings: int) -> Iterator[Path]:
    """A child of cgroup v1 ``controller``'s root with ``settings`` written to ``<controller>.<name>``;
    skips in one line (fails under CI=true) where this process cannot make one. Removed after, once
    every process in it is gone (waited for, bounded: a process left makes the removal fail the test)."""
    root = CGROUP_V1 / controller
    if not (root / "cgroup.procs").exists():
        tier_cannot_run(f"no cgroup v1 {controller} controller at {root}")
    path = root / f"multigpu-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        for name, value in settings.items():
            (path / f"{controller}.{name}").write_text(str(value))
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        tier_cannot_run(f"cannot make a child {controller} cgroup here (root needed): {exc.strerror}")
    try:
        yield path
    finally:
        deadline = time.monotonic() + 15
        while (path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        path.rmdir()


def cpu_group(**settings: int) -> contextlib.AbstractContextManager[Path]:
    """A child cgroup v1 CPU folder with ``settings`` (``cfs_quota_us=15000``: 15% of one core over
    the default 100 ms period; ``shares``: its weight against the machine's other processes)."""
    return v1_group("cpu", **settings)
