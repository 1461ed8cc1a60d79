"""Code that runs inside a training process: the bootstrap that starts the user's script, module,
function or program, and the API the training loop calls (``multigpu.heartbeat``, ``multigpu.section``,
``multigpu.preempted``, ``multigpu.should_stop``).

Entered as ``python -m multigpu.rank`` (``__main__``), or by the template's forked child. It imports
only ``contract``: nothing of the launcher's side, and no torch (the user's code brings it).
"""
