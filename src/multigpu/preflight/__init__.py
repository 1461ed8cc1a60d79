"""The node's preflight check (``--preflight``): a short process of its own on every node, after the
rendezvous and before any rank, that times a matmul on the node's device and all_reduce between the
nodes, and hands every node's figures to its launcher (``runner/preflight.py`` judges them).

Runs in the check process: forked from the node's template (torch is imported there already; the
template itself stays free of threads), or ``python -m multigpu.preflight`` where no template serves.
"""
