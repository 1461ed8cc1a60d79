"""The ``multigpu`` command's entry point (and ``python -m multigpu``): runs in the launcher.

Before the command line is parsed, and before anything but the standard library and the template's
launcher-side module is imported, ``multigpu run`` starts the node's warm template
(``template.process.start_early``), so the template's ``import torch`` overlaps the launcher's own
start instead of following it. An early template that the run does not adopt (a usage mistake, a
command that needs none) is ended here on the way out.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The command; as the program (``argv`` None), its way out too (``store_threads.leave``): a
    thread of ours still inside a store call must not be there while the interpreter finalizes."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from multigpu.console.writer import ensure_std_fds
        from multigpu.template.process import close_early, start_early

        ensure_std_fds()  # before the early template's socket can take a closed 0-2
        start_early(args)
        try:
            from multigpu.cli.main import main as cli_main

            code = cli_main(args)
        finally:
            close_early()
    except KeyboardInterrupt as exc:  # a Ctrl-C while the launcher itself starts (its imports)
        from multigpu.cli.main import interrupted

        interrupted(exc, args[0] if args else None)
        return 130
    return code if argv is not None else leave(code)


def leave(code: int) -> int:
    """``code``, or no return at all where a store thread of ours is still in a call (then the
    process ends with ``code`` without finalizing). Nothing is imported for a command that made none."""
    if "multigpu.rendezvous.store_threads" not in sys.modules:
        return code
    from multigpu.rendezvous.store_threads import leave as leave_safely

    return leave_safely(code)
