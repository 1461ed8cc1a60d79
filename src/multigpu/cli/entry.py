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
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from multigpu.console.writer import ensure_std_fds
        from multigpu.template.process import close_early, start_early

        ensure_std_fds()  # before the early template's socket can take a closed 0-2
        start_early(args)
        try:
            from multigpu.cli.main import main as cli_main

            return cli_main(args)
        finally:
            close_early()
    except KeyboardInterrupt as exc:  # a Ctrl-C while the launcher itself starts (its imports)
        from multigpu.cli.main import interrupted

        interrupted(exc, args[0] if args else None)
        return 130
