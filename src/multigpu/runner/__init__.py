"""``multigpu run``'s attempts on one node: runs in the launcher.

``attempts`` turns a configuration into attempts and an exit code (restarts, the ``crash_loop``
stop, preemption), ``attempt`` runs one of them; every ``membership`` meets the job the same way:
a fixed set of nodes through ``static_join``, an elastic job through torch's ``rounds``. ``specs``
(with ``torchrun_rules``, torchrun's per-option rules) builds what every rank is started with, also
for function mode; ``live_view`` is the rich table on a terminal; ``preempt_watch`` the launcher's
watch over a preemption warning. The run's record is ``record/``'s.
"""
