"""The one parser of each kind of value a user types. No processes."""

from __future__ import annotations

import pytest

from multigpu.contract.errors import UsageError
from multigpu.contract.values import module_names


def test_module_names_are_split_trimmed_and_checked() -> None:
    assert module_names(" json, os.path ,,", "--preload") == ("json", "os.path")
    with pytest.raises(UsageError, match="--preload takes module names, comma separated; got 'a-b'"):
        module_names("json,a-b", "--preload")
