"""``multigpu.launch``'s checks before anything starts. No processes."""

from __future__ import annotations

import threading

import pytest

import multigpu
from multigpu.contract.errors import MultiGPUError
from multigpu.function.launch_call import launch


def test_the_facade_names_it() -> None:
    assert multigpu.launch is launch


def test_what_cannot_be_pickled_is_refused_before_any_process(tmp_path: object) -> None:
    lock = threading.Lock()
    with pytest.raises(MultiGPUError, match="cannot be sent to the ranks"):
        launch(lambda: lock, nprocs=2, device="cpu")


def test_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        launch(42, nprocs=2, device="cpu")  # type: ignore[arg-type]


def test_an_unknown_option_starts_nothing() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        launch(print, nprocs=2, device="cpu", bogus=1)
