"""``python -m multigpu.rank MODE TARGET [ARGS...]``: the command every fresh rank process runs.

Runs in the rank. Tiny on purpose: the bootstrap lives in ``bootstrap``, which the template's forked
child (``template/child.py``) enters without this module.
"""

from multigpu.rank.bootstrap import main

main()
