"""Which template a launch gets: one kept from the launch before (``retain``) is adopted only by a
launch it can serve (same interpreter, environment and preloads), and only where the launcher keeps
templates. Stand-ins, no processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest

from multigpu.contract.warm import Warm
from multigpu.template import process
from multigpu.template.process import TemplateProcess, keep_warm, retain, take_early


class FakeProcess:
    def __init__(self, exited: int | None = None) -> None:
        self.exited = exited

    def poll(self) -> int | None:
        return self.exited


class FakeTemplate:
    """What ``retain`` and ``take_early`` ask of a template: its process, settings, release and close."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] | None = None, **kwargs: Any) -> None:
        self.env, self.preload, self.python = env, preload, "python"
        self.process = FakeProcess(kwargs.get("exited"))
        self.releases = kwargs.get("releases", True)
        self.released = self.closed = False

    def release(self) -> bool:
        self.released = True
        return bool(self.releases)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def slot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(process, "_early", Warm(TemplateProcess.close))
    monkeypatch.setattr(process, "_keep", threading.Event())
    yield


def kept(template: FakeTemplate) -> bool:
    return retain(cast(TemplateProcess, template))


def test_a_launcher_that_does_not_keep_templates_ends_them() -> None:
    template = FakeTemplate({"A": "1"}, ())
    assert not kept(template) and not template.released  # `multigpu run`: the caller closes it


def test_a_kept_template_serves_the_next_launch_once_its_store_is_released() -> None:
    keep_warm()
    template = FakeTemplate({"A": "1", "OMP_NUM_THREADS": "2"}, ("numpy",))
    assert kept(template) and template.released
    assert take_early({"A": "1", "OMP_NUM_THREADS": "4"}, "python", ["numpy"]) is template
    assert take_early({"A": "1"}, "python", ["numpy"]) is None  # taken once


@pytest.mark.parametrize(
    ("env", "preload"),
    [({"A": "2"}, ("numpy",)), ({"A": "1"}, ()), ({"A": "1", "TORCH_LOGS": "+dynamo"}, ("numpy",))],
)
def test_a_kept_template_that_cannot_serve_the_launch_is_ended(
    env: dict[str, str], preload: tuple[str]
) -> None:
    keep_warm()
    template = FakeTemplate({"A": "1"}, ("numpy",))
    assert kept(template)
    assert take_early(env, "python", preload) is None and template.closed


def test_a_dead_or_broken_template_is_not_kept() -> None:
    keep_warm()
    dead, broken = FakeTemplate({}, (), exited=-9), FakeTemplate({}, (), releases=False)
    assert not kept(dead) and not dead.released
    assert not kept(broken) and broken.released
    fine, second = FakeTemplate({}, ()), FakeTemplate({}, ())
    assert kept(fine) and not kept(second)  # one kept at a time: the other is ended by its caller


def test_an_early_template_not_yet_configured_serves_any_preload() -> None:
    keep_warm()
    early = FakeTemplate({"A": "1"}, None)
    assert kept(early)
    assert take_early({"A": "1"}, "python", ["numpy"]) is early
