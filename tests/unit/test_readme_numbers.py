"""Every performance figure the README quotes is in the committed benchmark results.

The README's "Why switch" section quotes ratios and times from one benchmark run; a figure typed by
hand, or left behind after the code changed and the results were re-measured, fails here. A figure
is a decimal number with a unit (``0.13x``, ``0.14 s``, ``26.1 MiB``, ``0.104%``). A ratio must appear
as written (``0.13x``) in one of the committed result files; any other figure must appear there as a
number written the same way (the tables write a time as ``0.165 [0.118-0.167] s``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(x| s\b| MiB|%)")


def quoted_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Why switch")
    return text[start:text.index("\n## ", start + 1)]


def committed_results() -> str:
    return "\n".join(p.read_text() for p in sorted(RESULTS.glob("*.md")))


def figures(text: str) -> set[str]:
    return {number + unit for number, unit in FIGURE.findall(text)}


def test_the_readme_quotes_figures() -> None:
    assert len(figures(quoted_section())) >= 10, "the README's measured section lost its figures"


NUMBER = re.compile(r"(?<![\w.])\d+\.\d+(?![\d])")


def test_every_figure_the_readme_quotes_is_in_the_committed_results() -> None:
    results = committed_results()
    ratios = {f for f in figures(results) if f.endswith("x")}
    numbers = set(NUMBER.findall(results))
    missing = sorted(f"{number}{unit}" for number, unit in FIGURE.findall(quoted_section())
                     if (f"{number}x" not in ratios if unit == "x" else number not in numbers))
    assert not missing, f"quoted in the README but in no file under benchmarks/results: {missing}"
