"""Issue 31's fault matrix: every fault x {static, elastic} x {quiet, two busy CPUs} x {NumPy, none}.

Beside two busy CPUs each fault runs once per mode, with NumPy in one mode and without it in the other
(``under_load``): every fault still meets load with and without NumPy, and every pair of the four
factors is covered, in half the loaded cells (CI's 20 minutes; the quiet half keeps the whole product).

Every cell: each node that lives to tell it prints the same root cause, no traceback from our code or
torch's and no C++ frame on a launcher's console, no rank ended by our own dump signal, no node
falling back from the template, the stacks of every rank alive at the verdict in its log, the
documented exit code, and nothing left running: every process a cell starts carries a marker in its
environment, and none may carry it afterwards (one that does is ended by PID and the cell fails).

The whole matrix runs with ``-m ""`` (``scripts/fault_matrix.sh``, after the suite in CI); a few
quiet cells run in the suite itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cells import FAULTS, FORBIDDEN, JOB, Fault, our_frames

from helpers import (
    MULTIGPU,
    PYTHON,
    clean_env,
    free_port,
    memory_cgroup,
    node_args,
    numpy_site,
    wait_for_lines,
)

MARK = "MULTIGPU_MATRIX_CELL"
CELL_S = 90.0
SUITE = {("static", "quiet", "no-numpy", "kill0")}
"""The cell the suite runs too (the others run in the matrix tier: the suite stays under 8 minutes)."""


def under_load(mode: str, numpy: str, fault: str) -> bool:
    """Whether a loaded cell runs: NumPy for every other fault in static mode, the rest in elastic."""
    odd = list(FAULTS).index(fault) % 2 == 1
    return (numpy == "numpy") == (odd == (mode == "static"))


def cells() -> Iterator[object]:
    for mode in ("static", "elastic"):
        for load in ("quiet", "load"):
            for numpy in ("no-numpy", "numpy"):
                for fault in FAULTS:
                    if load == "load" and not under_load(mode, numpy, fault):
                        continue
                    marks = [] if (mode, load, numpy, fault) in SUITE else [pytest.mark.matrix]
                    yield pytest.param(
                        mode,
                        load,
                        numpy,
                        fault,
                        id=f"{mode}-{load}-{numpy}-{fault}",
                        marks=[pytest.mark.slow, pytest.mark.integration, *marks],
                    )


@contextlib.contextmanager
def busy_cpus(load: str) -> Iterator[None]:
    """Two processes spinning on a CPU each for the cell's length (none on a quiet cell). Where
    ``scripts/fault_matrix.sh`` runs the loaded half, it keeps two running beside the whole half
    (``MULTIGPU_MATRIX_HOGS=outside``): two cells at once must not mean four."""
    own = load == "load" and os.environ.get("MULTIGPU_MATRIX_HOGS") != "outside"
    hogs = [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(2 if own else 0)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def marked(marker: str) -> list[int]:
    """Every process whose environment carries this cell's marker."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            if f"{MARK}={marker}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
    return found


def left_behind(marker: str, timeout: float = 5.0) -> list[int]:
    """The marked processes still alive after ``timeout``, each ended by PID (and reported)."""
    deadline = time.monotonic() + timeout
    while (pids := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


class Cell:
    """The launchers of one cell, their consoles in files under ``tmp_path``."""

    def __init__(self, tmp_path: Path, mode: str, numpy: str, fault: Fault) -> None:
        self.tmp, self.fault, self.marker = tmp_path, fault, uuid.uuid4().hex
        self.elastic = mode == "elastic"
        self.env = {MARK: self.marker}
        if numpy == "numpy":
            site = numpy_site()
            if site is None:
                pytest.skip("pip could not install numpy here")
            # after any PYTHONPATH the tests run under (a checkout's src/): NumPy joins, nothing is replaced
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(site))))
        self.port = free_port()
        (tmp_path / "cell.py").write_text(JOB)
        (tmp_path / "other.py").write_text(JOB + "# another script\n")
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def argv(self, node: int) -> list[str]:
        script = "other.py" if self.fault.name == "mismatch" and node == 1 else "cell.py"
        return [
            *MULTIGPU,
            "run",
            *self.layout(node),
            "--nproc-per-node",
            "1",
            "--grace-period",
            "1",
            "--output",
            str(self.tmp / f"out{node}"),
            *self.fault.launcher_args,
            script,
            self.fault.name,
            str(self.fault.steps),
            str(self.fault.step_s),
        ]

    def layout(self, node: int) -> list[str]:
        """Node ``node`` of two: an elastic round of exactly two (it still names its rank), or static."""
        if self.elastic:
            return [*node_args(node, "2:2", endpoint=f"127.0.0.1:{self.port}"), "--rdzv-id", "matrix"]
        return node_args(node, master_port=self.port)

    def start(self, node: int, cgroup: Path | None = None) -> None:
        argv = self.argv(node)
        if cgroup is not None:  # the launcher and all it starts in the small memory cgroup
            argv = ["bash", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "bash", *argv]
        with open(self.tmp / f"out_{node}.txt", "wb") as out, open(self.tmp / f"err_{node}.txt", "wb") as err:
            self.procs[node] = subprocess.Popen(
                argv, cwd=self.tmp, env=clean_env(self.env), stdout=out, stderr=err, stdin=subprocess.DEVNULL
            )

    def console(self, node: int) -> str:
        return "".join(
            (self.tmp / f"{kind}_{node}.txt").read_text(errors="replace") for kind in ("out", "err")
        )

    def wait(self) -> dict[int, int | None]:
        deadline = time.monotonic() + CELL_S
        codes: dict[int, int | None] = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[node] = None
        return codes


def act(cell: Cell) -> None:
    """The launcher-level faults: once rank 0 has done step 2, signal a launcher."""
    name = cell.fault.name
    if name not in ("term1", "kill0", "kill1"):
        return
    wait_for_lines(cell.tmp / "out_0.txt", r"step 2", 1, timeout=60)
    targets = {"term1": (1, signal.SIGTERM), "kill0": (0, signal.SIGKILL), "kill1": (1, signal.SIGKILL)}
    node, sig = targets[name]
    cell.procs[node].send_signal(sig)


def check(cell: Cell, codes: dict[int, int | None]) -> None:
    fault = cell.fault
    for node in fault.nodes:
        expected, console = fault.codes[node], cell.console(node)
        if expected is None:
            continue  # the node the test killed
        assert codes[node] == expected, f"node {node} exit {codes[node]}, expected {expected}:\n{console}"
        for text in FORBIDDEN:
            assert text not in console, f"node {node} printed {text!r}:\n{console}"
        assert not our_frames(console), f"node {node} printed our or torch's frames:\n{console}"
        cause = fault.elastic_cause if cell.elastic and fault.elastic_cause is not None else fault.cause
        if cause:
            verdict = [line for line in console.splitlines() if cause in line]
            assert verdict, f"node {node} never said {cause!r}:\n{console}"
    roots = {
        node: [x for x in cell.console(node).splitlines() if x.startswith("root cause:")]
        for node in fault.nodes
        if fault.codes[node] not in (None, 0)
    }
    firsts = {tuple(lines[:1]) for lines in roots.values() if lines}
    assert len(firsts) <= 1, f"the nodes disagree on the root cause: {roots}"
    if fault.survivor_stacks:  # its stacks as the verdict found it (in a collective, or on its way out)
        log = (cell.tmp / "out0" / "logs" / "attempt_0" / "rank_0.log").read_text(errors="replace")
        assert "(most recent call first)" in log or 'cell.py", line' in log, (
            f"rank 0's stacks (or its own traceback) are not in its log:\n{log[-3000:]}"
        )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "load", "numpy", "fault"), list(cells()))
def test_cell(tmp_path: Path, mode: str, load: str, numpy: str, fault: str) -> None:
    cell = Cell(tmp_path, mode, numpy, FAULTS[fault])
    with contextlib.ExitStack() as stack:
        cgroup = stack.enter_context(memory_cgroup("600M")) if fault == "oom" else None
        stack.enter_context(busy_cpus(load))
        try:
            for node in cell.fault.nodes:
                cell.start(node, cgroup if node == 1 else None)
            act(cell)
            codes = cell.wait()
        finally:
            left = left_behind(cell.marker)
        check(cell, codes)
        assert not left, f"left running: {left}"
