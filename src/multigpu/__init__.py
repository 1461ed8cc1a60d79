"""multigpu: launch and supervise PyTorch distributed training on GPUs, CPU workers and nodes.

The top level re-exports the OTX-compatible API lazily, so ``import multigpu`` (and every worker's
bootstrap) stays free of torch until a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .argv import set_arguments_to_argv
    from .devices import get_gpu_ids
    from .environment import is_multigpu_child_process
    from .errors import MultiGPUError, RendezvousError, UsageError, WorkerFailedError, WorkerFailure
    from .manager import MultiGPUManager
    from .preemption import preempted, should_stop
    from .progress import heartbeat, section

_EXPORTS = {
    "get_gpu_ids": "devices",
    "is_multigpu_child_process": "environment",
    "set_arguments_to_argv": "argv",
    "MultiGPUManager": "manager",
    "heartbeat": "progress",
    "preempted": "preemption",
    "should_stop": "preemption",
    "section": "progress",
    "MultiGPUError": "errors",
    "UsageError": "errors",
    "RendezvousError": "errors",
    "WorkerFailedError": "errors",
    "WorkerFailure": "errors",
}

__all__ = [
    "MultiGPUError",
    "MultiGPUManager",
    "RendezvousError",
    "UsageError",
    "WorkerFailedError",
    "WorkerFailure",
    "__version__",
    "get_gpu_ids",
    "heartbeat",
    "is_multigpu_child_process",
    "preempted",
    "section",
    "set_arguments_to_argv",
    "should_stop",
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
