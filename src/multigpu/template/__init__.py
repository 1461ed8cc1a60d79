"""The node's warm worker template: one process per node that imports torch once and forks every rank.

Three processes meet here, one module each: ``server`` runs in the template process (entered as
``python -m multigpu.template``), ``child`` runs in a rank just forked from it (and then enters the
rank bootstrap), and ``client`` and ``process`` run in the launcher, which starts the template (first
thing, in ``multigpu run``) and asks it for ranks. ``wire`` is their channel, used by both ends; the
launcher's modules import neither of the others.
"""
