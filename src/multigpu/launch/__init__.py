"""``multigpu run`` on one node: runs in the launcher.

``attempts`` turns a configuration into attempts and an exit code (restarts, crash loops,
preemption), ``attempt`` runs one of them, ``meeting`` is where this node meets the job, ``elastic``
the round loop of an elastic job; ``specs`` (with ``torchrun``'s per-option rules) builds what every
rank is started with, also for function mode; ``record``, ``report`` and ``status`` are ``run.json``,
the failure report and the live view; ``rundir`` the output folder; ``restarts`` the restart policy;
``preemption`` the launcher's watch over a preemption warning.
"""
