"""Every performance figure the README quotes is in its own row of the committed benchmark results.

The README's "Why switch" section quotes ratios and times from one benchmark run; a figure typed by
hand, or left behind after the code changed and the results were re-measured, fails here. A figure
is a decimal number with a unit (``0.13x``, ``0.14 s``, ``26.1 MiB``, ``0.104%``).

Each figure is looked up only where its claim says it comes from: a table row ending in ``[N]`` in
section N of RESULTS.md, a row or paragraph that links a file under benchmarks/results in that file,
anything else in RESULTS.md and the other result files. There it must stand in one row (one line) as a
figure of the same kind: a ratio as written (``0.13x``), a percentage or a size with its unit
(``0.035%``, ``26.9 [26.9-26.9] MiB``), a time as a cell's number (``0.165 [0.118-0.167] s``,
``1.45 (1.37-1.63)``, ``1.40 / 1.52``) or its range's end. A number that merely occurs somewhere
(a min in another table, a timestamp, a ratio where a time was meant) does not count.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(x| s\b| MiB|%)")
SECTION_REF = re.compile(r"\[§?(\d+)\](?:\(benchmarks/results/RESULTS\.md#[\w-]+\))?\s*\|?\s*$")
"""A claim's source section: ``[N]`` or a link ``[§N](benchmarks/results/RESULTS.md#N-...)`` ending it."""
RESULT_LINK = re.compile(r"\]\((?:benchmarks/results/)?([\w.-]+\.md)(?:#[\w-]*)?\)")
"""A link to a results file: from the README, or from NOTES.md beside the results (relative)."""
NOTES = "NOTES.md"
"""The lab notes that left the README (issue 40): they quote the results, so they are no source."""


def quoted_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Why switch")
    return text[start : text.index("\n## ", start + 1)]


def results_files() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(RESULTS.glob("*.md")) if p.name != NOTES}


def notes_section() -> str:
    """NOTES.md from its table on: the README's former "Why switch", checked as the README was."""
    text = (RESULTS / NOTES).read_text()
    return text[text.index("## Why switch") :]


def figures(text: str) -> set[str]:
    return {number + unit for number, unit in FIGURE.findall(text)}


def section_of(results: str, number: int) -> str:
    """Section ``number`` of RESULTS.md (``## N. title`` up to the next ``## ``)."""
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", results, re.M | re.S)
    assert match, f"RESULTS.md has no section {number}"
    return match.group(0)


def claims(section: str, files: dict[str, str]) -> list[tuple[str, str]]:
    """(claim text, the results text it is checked against): each table row, each prose paragraph."""
    everything = "\n".join(files.values())
    out = []
    for para in section.split("\n\n"):
        units = para.splitlines() if para.startswith("|") else [para]
        for unit in units:
            ref, links = SECTION_REF.search(unit), RESULT_LINK.findall(unit)
            if ref:
                source = section_of(files["RESULTS.md"], int(ref.group(1)))
            elif links:
                source = "\n".join(files[name] for name in links if name in files) or everything
            else:
                source = everything
            out.append((unit, source))
    return out


def in_a_row(number: str, unit: str, rows: list[str]) -> bool:
    """``number`` stands in one of ``rows`` as a figure of the same kind (see the module's docstring)."""
    n = re.escape(number)
    if unit == "x":
        pattern = rf"(?<![\w.]){n}x"
    elif unit in ("%", " MiB"):  # written as such, or as a cell: "26.9 [26.9-26.9] MiB"
        pattern = rf"(?<![\w.]){n}(?: \[[^\]]*\])? ?{unit.strip()}"
    else:  # a time: a cell's value, its [min-max] or (min-max) range, or one side of "joined / exit"
        pattern = rf"(?<![\w.]){n}(?= s\b| \[| \(| /|\)|\]|-)|[-/(] ?{n}(?![\d.])"
    return any(re.search(pattern, row) for row in rows)


def missing(section: str, files: dict[str, str]) -> list[str]:
    out = []
    for claim, source in claims(section, files):
        rows = source.splitlines()
        out += [
            f"{number}{unit}" for number, unit in FIGURE.findall(claim) if not in_a_row(number, unit, rows)
        ]
    return sorted(out)


def test_the_readme_quotes_figures() -> None:
    assert len(figures(quoted_section())) >= 10, "the README's measured section lost its figures"
    assert (
        sum(1 for _, source in claims(quoted_section(), results_files()) if source.startswith("## ")) >= 4
    ), "the README's rows lost their [N] section references"


def test_every_figure_the_readme_quotes_is_in_its_own_row_of_the_results() -> None:
    gone = missing(quoted_section(), results_files())
    assert not gone, f"quoted in the README but in no matching row of benchmarks/results: {gone}"


def test_a_figure_from_another_row_or_section_is_caught() -> None:
    """The check can fail: a figure moved to another section, a ratio quoted as a time, a changed digit."""
    files = results_files()
    assert missing("| SIGKILL | x | gone in 0.031 s [3] |", files) == []
    assert missing("| SIGKILL | x | gone in 0.349 s [3] |", files) == ["0.349 s"]  # section 4's torchrun
    assert missing("| SIGKILL | x | gone in 0.036 s [3] |", files) == ["0.036 s"]
    assert missing("| SIGTERM | x | all gone 0.10 s [4] |", files) == ["0.10 s"]  # that is the ratio, 0.10x
    assert missing("| bad input | x | 0.14x [5] |", files) == []
    assert missing("| bad input | x | 0.15x [5] |", files) == ["0.15x"]
    assert missing("| idle | x | 0.312% [8] |", files) == []
    assert missing("| idle | x | 0.312 MiB [8] |", files) == ["0.312 MiB"]


def test_the_notes_that_left_the_readme_quote_the_results_too() -> None:
    """The lab notes keep the README's old table and paragraphs; their figures stay checked."""
    assert len(figures(notes_section())) >= 30, "NOTES.md lost the README's former figures"
    gone = missing(notes_section(), results_files())
    assert not gone, f"quoted in NOTES.md but in no matching row of benchmarks/results: {gone}"


def slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_row_of_the_table_links_its_results() -> None:
    """Each row of "Why switch" ends in a link to the file it quotes, and each section link lands."""
    rows = [line for line in quoted_section().splitlines() if line.startswith("| ") and "---" not in line]
    results = results_files()
    anchors = {slug(h) for h in re.findall(r"^## (.*)$", results["RESULTS.md"], re.M)}
    assert len(rows) >= 10
    for row in rows[1:]:  # the first is the header
        link = re.search(r"\]\(benchmarks/results/([\w.-]+\.md)(?:#([\w-]+))?\) \|$", row)
        assert link, f"a row without a link to its results file: {row[:80]}"
        assert link.group(1) in results, row[:80]
        assert link.group(2) is None or link.group(2) in anchors, f"no such section: {link.group(2)}"
        ref = SECTION_REF.search(row)
        assert ref is None or f"{link.group(2)}".startswith(ref.group(1) + "-"), row[:80]
