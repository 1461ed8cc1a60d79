"""``set_arguments_to_argv`` and ``remove_option``: the seed's rules and issue 2's fixes."""

from __future__ import annotations

import sys

import pytest

from multigpu import set_arguments_to_argv
from multigpu.otx.argv import remove_option


def run(
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    keys: str | list[str],
    value: str | None = None,
    after_params: bool = False,
) -> list[str]:
    monkeypatch.setattr(sys, "argv", list(argv))
    set_arguments_to_argv(keys, value, after_params=after_params)
    return sys.argv


@pytest.mark.parametrize(
    ("argv", "keys", "value", "expected"),
    [
        # an existing key: its value is replaced
        (["t.py", "--lr", "0.1", "x"], "--lr", "0.5", ["t.py", "--lr", "0.5", "x"]),
        # an alias from keys is recognised; the alias stays as the user wrote it
        (["t.py", "-o", "a", "x"], ["--output", "-o"], "b", ["t.py", "-o", "b", "x"]),
        (["t.py", "--output", "a"], ["-o", "--output"], "b", ["t.py", "--output", "b"]),
        # --key=value is replaced in place
        (["t.py", "--lr=0.1", "x"], "--lr", "0.5", ["t.py", "--lr=0.5", "x"]),
        (["t.py", "-o=a", "params"], ["--output", "-o"], "b", ["t.py", "-o=b", "params"]),
        # the key as the last token gets its value appended
        (["t.py", "x", "--lr"], "--lr", "0.5", ["t.py", "x", "--lr", "0.5"]),
        # a key followed by another option gets its value inserted, not overwriting the option
        (["t.py", "--lr", "--bs", "8"], "--lr", "0.5", ["t.py", "--lr", "0.5", "--bs", "8"]),
        (["t.py", "--lr", "-v"], "--lr", "0.5", ["t.py", "--lr", "0.5", "-v"]),
        # ... or by params
        (
            ["t.py", "--lr", "params", "--a", "1"],
            "--lr",
            "0.5",
            ["t.py", "--lr", "0.5", "params", "--a", "1"],
        ),
        # a negative number after the key is a value, and is replaced
        (["t.py", "--shift", "-3"], "--shift", "2", ["t.py", "--shift", "2"]),
        # a missing key goes just before params ...
        (
            ["t.py", "x", "params", "--a", "1"],
            "--lr",
            "0.5",
            ["t.py", "x", "--lr", "0.5", "params", "--a", "1"],
        ),
        # ... or at the end without params; keys[0] is what is inserted
        (["t.py", "x"], ["--output", "-o"], "d", ["t.py", "x", "--output", "d"]),
        # a missing key without a value is inserted alone
        (["t.py", "params"], "--flag", None, ["t.py", "--flag", "params"]),
        (["t.py"], "--flag", None, ["t.py", "--flag"]),
    ],
)
def test_set_arguments_to_argv(
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    keys: str | list[str],
    value: str | None,
    expected: list[str],
) -> None:
    assert run(monkeypatch, argv, keys, value) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["t.py", "--lr", "0.1"],
        ["t.py", "--lr=0.1", "params"],
        ["t.py", "--lr"],
        ["t.py", "--lr", "--x"],
    ],
)
def test_existing_key_without_value_leaves_argv_unchanged(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    assert run(monkeypatch, argv, "--lr") == argv


def test_only_the_first_occurrence_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["t.py", "--lr", "1", "--lr", "2"]
    assert run(monkeypatch, argv, "--lr", "3") == ["t.py", "--lr", "3", "--lr", "2"]


def test_prefix_of_another_option_is_not_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run(monkeypatch, ["t.py", "--lr-decay", "0.9"], "--lr", "0.5") == [
        "t.py",
        "--lr-decay",
        "0.9",
        "--lr",
        "0.5",
    ]


def test_after_params_adds_params_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run(monkeypatch, ["t.py", "x"], "--lr", "0.5", after_params=True) == [
        "t.py",
        "x",
        "params",
        "--lr",
        "0.5",
    ]


def test_after_params_goes_after_existing_params(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run(monkeypatch, ["t.py", "x", "params", "--a", "1"], "--lr", "0.5", after_params=True) == [
        "t.py",
        "x",
        "params",
        "--a",
        "1",
        "--lr",
        "0.5",
    ]


def test_after_params_still_replaces_an_existing_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run(
        monkeypatch, ["t.py", "params", "--lr", "0.1", "--a", "1"], "--lr", "0.5", after_params=True
    ) == ["t.py", "params", "--lr", "0.5", "--a", "1"]


def test_empty_keys_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["t.py", "x"])
    with pytest.raises(ValueError, match="key"):
        set_arguments_to_argv([], "1")
    assert sys.argv == ["t.py", "x"]


def test_sys_argv_is_edited_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["t.py", "x"]
    monkeypatch.setattr(sys, "argv", argv)
    set_arguments_to_argv("--lr", "1")
    assert sys.argv is argv and argv == ["t.py", "x", "--lr", "1"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["t.py", "--gpus", "0,1", "x"], ["t.py", "x"]),
        (["t.py", "--gpus=0,1", "x"], ["t.py", "x"]),
        (["t.py", "x", "--gpus"], ["t.py", "x"]),
        (["t.py", "--gpus", "--lr", "1"], ["t.py", "--lr", "1"]),
        (["t.py", "--gpus", "params", "--a", "1"], ["t.py", "params", "--a", "1"]),
        (["t.py", "--gpus", "0", "--gpus=1", "y"], ["t.py", "y"]),
        (["t.py", "--gpus-per-node", "2"], ["t.py", "--gpus-per-node", "2"]),
        (["t.py", "x"], ["t.py", "x"]),
    ],
)
def test_remove_option_every_form(argv: list[str], expected: list[str]) -> None:
    original = list(argv)
    assert remove_option(argv, "--gpus") == expected
    assert argv == original  # a copy, not an edit


def test_remove_flag_without_value_keeps_next_token() -> None:
    assert remove_option(["t.py", "--enable-hpo", "x"], "--enable-hpo", takes_value=False) == ["t.py", "x"]
