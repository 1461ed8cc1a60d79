"""``multigpu.launch`` and ``multigpu.spawn``: a function run on ranks, from Python or a notebook.

Runs in the caller (``launch_call``, ``launch_config``, ``launch_errors``, ``spawning``), which never
becomes a rank: each launch is handed to ``multigpu run``'s launcher in its own process (``launcher``,
kept warm by ``launcher_handle``), whose ranks fork from the template and run ``rank_call``.
OTX's ``MultiGPUManager``, which makes the caller rank 0, is another product: ``otx/``.
"""
