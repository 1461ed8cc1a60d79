"""What the supervisor's tests share: the ``make`` fixture, which builds supervisors that are always
closed. The launcher's own lines a supervisor says are read from ``caplog`` (``helpers.logged``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from helpers import supervisor_arguments
from multigpu.supervisor.loop import Supervisor
from multigpu.supervisor.states import WorkerSpec

GRACE = 0.3
"""The grace period of every supervisor ``make`` builds, unless a test gives its own."""


@pytest.fixture
def make() -> Iterator[Callable[..., Supervisor]]:
    """Build supervisors from flat keyword arguments (``helpers.supervisor_arguments``), with a short
    grace period; every one is closed at the end of the test, with no grace."""
    made: list[Supervisor] = []

    def build(specs: list[WorkerSpec], **kwargs: object) -> Supervisor:
        kwargs.setdefault("grace_period", GRACE)
        sup = Supervisor(specs, **supervisor_arguments(**kwargs))
        made.append(sup)
        return sup

    yield build
    for sup in made:
        sup.close(grace_period=0)
