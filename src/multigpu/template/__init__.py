"""The node's warm worker template: one process per node that imports torch once and forks every rank.

Three processes meet here, one module each: ``server`` runs in the template process (entered as
``python -m multigpu.template``), ``child`` runs in a rank just forked from it (and then enters the
rank bootstrap), and ``client`` runs in the launcher, which starts the template and asks it for
ranks. ``wire`` is their channel, used by both ends; the client imports neither of the others.
"""
