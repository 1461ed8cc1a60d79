"""The thread pools a rank's libraries start: held to one thread in the template, sized in each rank.

Runs in three processes: the launcher starts the template with ``held(env)``; the template finds its
BLAS libraries once (``Pools``); each rank forked from it sizes every pool as its own environment says
(``Pools.apply``), so it behaves as a fresh process with that environment would.

Why: a process with threads must not fork, and ``import torch`` imports NumPy where it is installed,
whose OpenBLAS starts its thread pool at load, sized by ``OPENBLAS_NUM_THREADS``, else
``OMP_NUM_THREADS``, else the CPU count. Unheld, the template of a node running one rank on a
multi-core machine (every multi-node job, one rank per node) had a second thread and refused to
fork. Held to one, nothing starts at import; the rank then asks for what it was given: OpenMP through
``torch.set_num_threads`` (what torch does at start from ``OMP_NUM_THREADS``) and the BLAS libraries
through threadpoolctl, the library made for their pools. The rank calls ``apply`` only once the
launcher's dump request signal is blocked (``rank/dump_signal.block_dump_requests``): the threads these
libraries start inherit the block, so the request can only reach the rank's dump thread.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

HELD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "BLIS_NUM_THREADS": "1"}
"""The template's own values, whatever the ranks get: every pool a library may start at import, held
to one thread."""

BLAS_READS = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
}
"""The variables each BLAS (threadpoolctl's ``internal_api``) reads at load, first set wins; none set:
as many threads as the process may use CPUs."""

TORCH_READS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
"""What torch sizes its intra-op pool by at start (``at::intraop_default_num_threads``: MKL's variable
wins over OpenMP's)."""


def held(env: Mapping[str, str]) -> dict[str, str]:
    """The template's environment: the ranks' shared one, with every pool held to one thread."""
    return {**env, **HELD}


def wanted(names: Iterable[str], env: Mapping[str, str], default: int) -> int:
    """The first positive count among ``names`` in ``env``, as the libraries parse it; else ``default``."""
    for name in names:
        text = env.get(name, "").strip().split(",")[0]
        if text.isdigit() and int(text) > 0:
            return int(text)
    return default


def cpu_count() -> int:
    """What a library sizes its pool by when no variable says: the CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_default() -> int:
    """torch's intra-op pool with neither variable set: the machine's physical cores (cpuinfo's count)."""
    import psutil

    return int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)


class Pools:
    """The template's BLAS libraries, found once in the template (threadpoolctl scans every loaded
    library, 2-7 ms) so that a rank only sets their sizes. A handle found before the fork is valid
    after it: the libraries are at the same addresses in the rank."""

    def __init__(self) -> None:
        self.blas: list[Any] = []
        with contextlib.suppress(Exception):  # threadpoolctl missing or a library it cannot read
            from threadpoolctl import ThreadpoolController

            self.blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]

    def apply(self, env: Mapping[str, str]) -> None:
        """Size torch's OpenMP pool and each BLAS pool as a fresh process with ``env`` would have."""
        import torch

        threads = wanted(TORCH_READS, env, torch_default())
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        for lib in self.blas:
            count = wanted(BLAS_READS.get(lib.internal_api, ("OMP_NUM_THREADS",)), env, cpu_count())
            with contextlib.suppress(Exception):
                if lib.num_threads != count:
                    lib.set_num_threads(count)
