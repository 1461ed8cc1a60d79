"""The launcher's open-file limit (``contract/limits.py``): the soft limit goes up to the hard one, and a
second call changes nothing. The test puts this process's limit back as it found it."""

from __future__ import annotations

import resource

from multigpu.contract.limits import lift_open_file_limit


def test_the_soft_limit_is_lifted_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        low = min(soft, 256)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        now = lift_open_file_limit()
        assert now == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= low
        if hard != resource.RLIM_INFINITY:
            assert now == hard
        assert lift_open_file_limit() == now
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
