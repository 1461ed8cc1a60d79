"""Function mode, two ways to run a function on ranks.

``multigpu.launch`` and ``multigpu.spawn`` run in the caller (``launch_call``, ``launch_config``,
``launch_errors``, ``spawning``) and never make it a rank: they hand each launch to ``multigpu run``'s
launcher in its own process (``launcher``, kept warm by ``launcher_handle``), whose ranks fork from the
template and run ``rank_call``.

OTX's ``MultiGPUManager`` runs in the caller's process, which becomes local rank 0
(``manager``: the public API; ``prepare``: checks before any child starts; ``rank_setup``: what makes the
caller, and each child, a rank; ``watcher``: the children's ``Supervisor`` on a background thread;
``interrupt_caller``: a child's failure into the caller's code; ``argv``: OTX's command-line editing). The
children it starts run the ordinary rank bootstrap (``multigpu/rank``), then ``rank_setup``.
"""
