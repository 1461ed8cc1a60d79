"""``python -m multigpu.template``: the node's warm template process (see ``server``).

Runs in the template process, started by the launcher's ``template/client.py``.
"""

from multigpu.template.server import main

main()
