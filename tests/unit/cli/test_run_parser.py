"""``multigpu run --help``: the everyday options on its first screen, every option still accepted."""

from __future__ import annotations

import pytest

from multigpu.cli import options
from multigpu.cli.main import main
from multigpu.cli.option_table import Option
from multigpu.cli.run_parser import EVERYDAY, KNOBS, help_groups, run_parser

FIRST_SCREEN = ("--cpu", "--gpus", "--output", "--nnodes", "--node-rank", "--max-restarts", "--hang-timeout")
"""What a new user needs before reading further (issue 40): on the first 45 lines of ``--help``."""


def help_lines(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``multigpu run --help`` as a user sees it on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as info:
        main(["run", "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_the_first_45_lines_hold_the_everyday_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = help_lines(capsys, monkeypatch)
    first = [line.split()[0].rstrip(",") for line in lines[:45] if line.startswith("  -")]
    assert set(FIRST_SCREEN) <= set(first), f"not on the first screen: {set(FIRST_SCREEN) - set(first)}"
    assert len(lines) > 100  # the rest is still there, after them


def test_every_option_is_in_one_group_and_torchruns_lines_keep_their_text(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    grouped = [opt for _, group in help_groups() for opt in group]
    assert sorted(opt.dest for opt in grouped) == sorted(opt.dest for opt in options.ALL)
    assert len(grouped) == len(options.ALL)
    assert not set(KNOBS) & set(EVERYDAY)
    assert all(not options.BY_FLAG[f"--{dest.replace('_', '-')}"].torchrun for dest in KNOBS)
    text = "\n".join(help_lines(capsys, monkeypatch))
    for title in ("everyday options:", "multigpu options:", "multigpu aliases and tuning knobs:"):
        assert title in text
    assert "torchrun options (torch 2.13; dashes or underscores, --opt=value or --opt value):" in text
    assert text.index("everyday options:") < text.index("multigpu options:") < text.index("torchrun options")


@pytest.mark.parametrize("opt", options.ALL, ids=lambda opt: opt.dest)
def test_every_spelling_of_every_option_is_still_accepted(opt: Option) -> None:
    parser = run_parser()
    value = (opt.choices or ("1",))[0]
    for flag in opt.flags:
        parsed = vars(parser.parse_args([flag, value] if opt.takes_value else [flag]))
        assert parsed[opt.dest] == (value if opt.takes_value else True), flag
