"""``benchmarks/run.py`` as the README writes it (issue 22): ``--help`` in any Python, one line naming
the fix where the venv is missing, and ``--quick`` never writing into the committed results."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "run.py"
BARE = [sys.executable, "-S"]  # no site-packages: a system Python without psutil, torch or multigpu


def bare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BARE, str(RUN), *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


@pytest.mark.integration
def test_help_works_without_the_venv() -> None:
    result = bare("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: benchmarks/run.py") and "--quick" in result.stdout


@pytest.mark.integration
def test_a_run_without_the_venv_is_one_line_naming_the_fix() -> None:
    before = set(Path(tempfile.gettempdir()).glob("multigpu-bench-quick-*"))
    result = bare("--quick", "--only", "badinput")
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "psutil" in line and ".venv/bin/python benchmarks/run.py" in line
    assert ".venv/bin/pip install -e '.[dev]'" in line
    assert not set(Path(tempfile.gettempdir()).glob("multigpu-bench-quick-*")) - before, "a folder left"


def test_quick_writes_to_a_scratch_folder_never_the_committed_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run  # benchmarks/run.py

    monkeypatch.delitem(sys.modules, "run")

    args = run.parse_args(["--quick", "--only", "badinput"])
    assert args.out is None  # nothing made yet: a run refused for a missing package leaves no folder
    out = run.output_folder(args)
    try:
        assert out.resolve() != (ROOT / "benchmarks" / "results").resolve() and out.is_dir()
    finally:
        out.rmdir()
    with pytest.raises(SystemExit):
        run.parse_args(["--quick", "--out", str(ROOT / "benchmarks" / "results")])
