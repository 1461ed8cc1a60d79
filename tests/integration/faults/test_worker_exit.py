"""A rank that raises leaves at once, yet loses nothing: atexit handlers run, buffered files flush."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_gone, run_cli, write_script

pytestmark = pytest.mark.integration


def test_a_failing_rank_runs_atexit_and_flushes_open_files(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "fails.py",
        f"""
        import atexit, os
        atexit.register(lambda: open({str(tmp_path / "atexit.txt")!r}, "w").write("atexit ran"))
        log = open({str(tmp_path / "unflushed.txt")!r}, "w")
        log.write("buffered, never flushed by the script")
        print(f"pid={{os.getpid()}}", flush=True)
        raise RuntimeError("leaving with an unflushed file")
    """,
    )
    result = run_cli(["run", "--cpu", "1", "--output", str(tmp_path / "out"), str(script)], tmp_path)
    assert result.returncode == 1
    assert (tmp_path / "atexit.txt").read_text() == "atexit ran"
    assert (tmp_path / "unflushed.txt").read_text() == "buffered, never flushed by the script"
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    rank = record["attempts"][0]["ranks"]["0"]
    assert rank["exit_code"] == 1 and rank["state"] == "failed"
    assert (
        "RuntimeError: leaving with an unflushed file"
        in (tmp_path / "out" / "logs" / "attempt_0" / "rank_0.log").read_text()
    )
    assert_gone([rank["pid"]])
