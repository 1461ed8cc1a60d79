"""Function mode: OTX's ``MultiGPUManager``. Runs in the caller's process, which becomes local rank 0
(``manager``: the public API; ``prepare``: checks before any child starts; ``rank_setup``: what makes the
caller, and each child, a rank; ``watcher``: the children's ``Supervisor`` on a background thread;
``interrupt_caller``: a child's failure into the caller's code; ``argv``: OTX's command-line editing). The
children it starts run the ordinary rank bootstrap (``multigpu/rank``), then ``rank_setup``.
"""
