"""OTX's ``MultiGPUManager`` (the API of ``otx.cli.utils.multi_gpu``): runs in the caller's process, which
becomes local rank 0, and in the children it starts.

``manager`` (the public API), ``prepare`` (checks before any child starts), ``rank_setup`` (what makes
the caller, and each child, a rank), ``watcher`` (the children's ``Supervisor`` on a background thread of
the caller), ``interrupt_caller`` (a child's failure into the caller's code) and ``argv`` (OTX's
command-line editing). The children run the ordinary rank bootstrap (``multigpu/rank``), then
``rank_setup``.
"""
