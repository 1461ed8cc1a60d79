"""The README leads with the user (issue 40): short, no wall of a line, a ``multigpu run`` example early,
and the benchmark lab notes kept in ``benchmarks/results/NOTES.md`` rather than on its first screen."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOTES = ROOT / "benchmarks" / "results" / "NOTES.md"
MAX_LINES = 150
MAX_CHARS = 300
FIRST_EXAMPLE_BY = 40
LAB_NOTES = ("bound at 64 ranks is missed", "met a half-merged tree", "were\nnot re-run", "3 clock ticks")
"""Phrases of the run's notes: where they are, NOTES.md is; the README only links it."""

FENCE = re.compile(r"^```\w*[^\n]*\n(.*?)^```", re.M | re.S)


def lines() -> list[str]:
    return README.read_text().splitlines()


def command_lines(text: str) -> list[str]:
    """The lines inside the README's fenced blocks, stripped."""
    return [line.strip() for block in FENCE.findall(text) for line in block.splitlines()]


def test_the_readme_is_at_most_150_lines_none_over_300_characters() -> None:
    assert len(lines()) <= MAX_LINES, f"README.md has {len(lines())} lines"
    long = [(n, len(line)) for n, line in enumerate(lines(), start=1) if len(line) > MAX_CHARS]
    assert not long, f"README.md lines over {MAX_CHARS} characters (line, length): {long}"


def test_a_multigpu_run_example_within_the_first_40_lines() -> None:
    head = "\n".join(lines()[:FIRST_EXAMPLE_BY]) + "\n```\n"  # a block open at line 40 still counts
    assert any(line.startswith("multigpu run ") for line in command_lines(head)), (
        f"no 'multigpu run' command in a fenced block within README.md's first {FIRST_EXAMPLE_BY} lines"
    )


def test_the_lab_notes_live_beside_the_results_not_in_the_readme() -> None:
    readme, notes = README.read_text(), NOTES.read_text()
    assert not [phrase for phrase in LAB_NOTES if phrase in readme]
    assert all(phrase in notes for phrase in LAB_NOTES)
    assert "](benchmarks/results/NOTES.md)" in readme


def test_the_checks_find_what_they_look_for() -> None:
    """The first-40-lines check can fail: prose naming ``multigpu run`` is not an example."""
    block = "text `multigpu run x.py`\n```bash\nmultigpu run x.py\n```\n"
    assert command_lines(block) == ["multigpu run x.py"]
    assert command_lines("just `multigpu run x.py` in prose\n") == []
