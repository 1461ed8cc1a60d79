"""The command line, ``multigpu run|demo|devices``: runs in the launcher, before anything else.

``main`` parses into the run configuration (never a traceback for a usage mistake), ``options`` is
the one table of options (torchrun's and ours), ``torchrun``, ``layout`` and ``preemption`` map
option values onto the configuration, and ``demo`` is the ``multigpu demo`` application, whose
training function also runs in every rank it starts. Imports no torch until a job needs it.
"""
