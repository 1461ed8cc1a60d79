"""multigpu: launch and supervise PyTorch distributed training on GPUs, CPU workers and nodes.

The top level re-exports the OTX-compatible API lazily, so ``import multigpu`` (and every worker's
bootstrap) stays free of torch until a name that needs it is used.

It is also the one place that hides torch's "Failed to initialize NumPy: No module named 'numpy'"
UserWarning (torch installed without numpy warns so at import). Every process of a run imports this
package before torch: the launcher (multi-node runs import torch's store there), the node's template,
every rank (``python -m multigpu.rank`` or forked from the template) and the demo; so no first screen
starts with it. Only that exact message is hidden: numpy code fails at its own ``import numpy``.

For the same reason it installs the package logger's level and its one handler
(``console/log.py``): whichever module of multigpu a process imports first, its lines are shown.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from multigpu._version import __version__
from multigpu.console import log as _log  # noqa: F401 - the package logger, in every process

NUMPY_WARNING = "Failed to initialize NumPy: No module named 'numpy'"
warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)

if TYPE_CHECKING:
    from multigpu.cluster.devices import get_gpu_ids
    from multigpu.contract.environment import is_multigpu_child_process
    from multigpu.contract.errors import (
        MultiGPUError,
        RendezvousError,
        UsageError,
        WorkerFailedError,
        WorkerFailure,
    )
    from multigpu.function.launch_call import launch, shutdown
    from multigpu.function.spawning import ProcessExitedException, ProcessRaisedException, spawn
    from multigpu.otx.argv import set_arguments_to_argv
    from multigpu.otx.manager import MultiGPUManager
    from multigpu.rank.preempted import preempted, should_stop
    from multigpu.rank.progress import heartbeat, section

_EXPORTS = {
    "get_gpu_ids": "cluster.devices",
    "is_multigpu_child_process": "contract.environment",
    "set_arguments_to_argv": "otx.argv",
    "MultiGPUManager": "otx.manager",
    "launch": "function.launch_call",
    "shutdown": "function.launch_call",
    "spawn": "function.spawning",
    "ProcessRaisedException": "function.spawning",
    "ProcessExitedException": "function.spawning",
    "heartbeat": "rank.progress",
    "preempted": "rank.preempted",
    "should_stop": "rank.preempted",
    "section": "rank.progress",
    "MultiGPUError": "contract.errors",
    "UsageError": "contract.errors",
    "RendezvousError": "contract.errors",
    "WorkerFailedError": "contract.errors",
    "WorkerFailure": "contract.errors",
}

__all__ = [
    "MultiGPUError",
    "MultiGPUManager",
    "ProcessExitedException",
    "ProcessRaisedException",
    "RendezvousError",
    "UsageError",
    "WorkerFailedError",
    "WorkerFailure",
    "__version__",
    "get_gpu_ids",
    "heartbeat",
    "is_multigpu_child_process",
    "launch",
    "preempted",
    "section",
    "set_arguments_to_argv",
    "should_stop",
    "shutdown",
    "spawn",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'multigpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
