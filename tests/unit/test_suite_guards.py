"""The suite's own guards (tests/helpers.py): they must be able to fail, or they hide what they guard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import in_ci, record_problems, tier_cannot_run


def test_an_unreadable_or_broken_record_is_a_problem(tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp_path = tmp_path_factory.mktemp("records")  # not the test's tmp_path, which the fixture checks
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text('{"attempts": [')  # cut short
    (tmp_path / "run_node1.json").write_bytes(b"\xff\xfe")
    (tmp_path / "run.json").write_text(json.dumps({"attempts": "not a list"}))
    (tmp_path / "runner.json").write_text("not json, and not a record's name")
    problems = record_problems(tmp_path)
    assert problems[0].startswith("out/run.json: unreadable:"), problems
    assert problems[-1].startswith("run_node1.json: unreadable:"), problems
    assert "run.json: attempts: 'not a list' is not of type 'array'" in problems, problems
    assert not any("runner.json" in p for p in problems), problems
    shutil.rmtree(tmp_path)


def test_other_json_under_a_record_name_is_not_checked(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"not": "a record"}))
    assert record_problems(tmp_path) == []


@pytest.mark.parametrize(("ci", "fails"), [("", False), ("false", False), ("true", True), ("1", True)])
def test_a_tier_that_cannot_run_skips_locally_and_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch, ci: str, fails: bool
) -> None:
    monkeypatch.setenv("CI", ci)
    assert in_ci() is fails
    outcome = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(outcome, match="chromium is not installed") as caught:
        tier_cannot_run("chromium is not installed")
    assert str(caught.value).startswith("CI=true, and this tier cannot run: ") is fails
