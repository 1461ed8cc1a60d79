"""``python -m multigpu.preflight TASK``: the check process where no template forks it. Runs in it."""

import sys

from multigpu.preflight.check import main

sys.exit(main(sys.argv[1:]))
