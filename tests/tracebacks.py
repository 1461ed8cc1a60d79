"""Sample tracebacks a rank prints, shared by the console's folding tests and the failure report's."""

from __future__ import annotations

import os
import sysconfig

TORCH = os.path.join(sysconfig.get_paths()["purelib"], "torch", "nn", "parallel", "distributed.py")
USER = os.path.join(os.getcwd(), "train.py")

INTERRUPTED = f"""Traceback (most recent call last):
  File "{USER}", line 42, in <module>
    model = DDP(model)
            ^^^^^^^^^^
  File "{TORCH}", line 842, in __init__
    torch._dynamo.utils.get_optimize_ddp_mode() == "python_reducer"
  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load
KeyboardInterrupt""".splitlines()

FAILED = f"""Traceback (most recent call last):
  File "{USER}", line 7, in <module>
    raise ValueError("loss is NaN")
ValueError: loss is NaN""".splitlines()
