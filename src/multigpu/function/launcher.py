"""The launcher of one ``multigpu.launch``: ``python -m multigpu.function.launcher CONFIG CALLER_PID``.

Runs in its own process, started by the caller (``function/launch_call.py``), never in the caller: a
notebook kernel that has initialised CUDA or runs threads must not fork, and the launcher's signal
handling, subreaping and exit would not belong in a user's process. It is ``multigpu run``'s launcher
(``runner.attempts.launch``) given a ``RunConfig`` in function mode: the node's template is started
first (its ``import torch`` overlaps the rest), every rank is forked from it, and fail-fast, the root
cause, hang detection and ``run.json`` all apply. Its fate is tied to the caller's process
(``guard_parent``): when the caller dies, however it dies, the launcher, the template and every rank go.
"""

from __future__ import annotations

import os
import pickle
import sys


def main(argv: list[str]) -> int:
    from multigpu.template.process import start_early

    start_early(["run"])  # first: the template's import of torch overlaps everything below
    config_path, caller = argv
    from multigpu.rank.guard import guard_parent

    guard_parent(int(caller))
    with open(config_path, "rb") as f:
        config = pickle.load(f)
    from multigpu.runner.attempts import launch

    return launch(config, os.environ)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
