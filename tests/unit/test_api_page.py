"""``docs/api.md`` lists exactly the package's public names (``multigpu.__all__``), each once, in its
four groups, and every page it links to exists. Read in the test process; no processes."""

from __future__ import annotations

import re
from pathlib import Path

import multigpu

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
GROUPS = ["Launch from Python", "Inside the training loop", "Errors", "OTX"]


def listed(text: str) -> list[str]:
    """The names the page's entries start with (``- `NAME`: what it is``)."""
    return re.findall(r"^- `(\w+)`: ", text, flags=re.M)


def test_the_api_page_names_exactly_the_public_names_once_each() -> None:
    names = listed(API.read_text())
    assert sorted(names) == sorted(multigpu.__all__), "docs/api.md and multigpu.__all__ differ"
    assert len(names) == len(set(names)), "a name is listed twice"


def anchors(page: Path) -> set[str]:
    """The page's headings as GitHub links them: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_api_page_has_its_four_groups_and_its_links_exist() -> None:
    text = API.read_text()
    assert re.findall(r"^## (.+)$", text, flags=re.M) == GROUPS
    links = set(re.findall(r"\]\(([\w.-]+\.md)(?:#([\w-]*))?\)", text))
    assert links
    for page, anchor in sorted(links):
        assert (API.parent / page).exists(), page
        assert not anchor or anchor in anchors(API.parent / page), f"{page}#{anchor}"


def test_a_name_missing_from_the_page_is_caught() -> None:
    page = "## Errors\n\n- `UsageError`: bad input.\n- `UsageErrors are one line`\n"
    assert listed(page) == ["UsageError"]
