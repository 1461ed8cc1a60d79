"""The console: the launcher's own lines, the ranks' prefixed lines and function mode's caller lines. Runs in
the launcher (and in function mode's caller): one writer thread drains a bounded buffer onto the
terminal, so a paused pager or a closed descriptor never blocks supervision; ``folding`` keeps
C++ stacks and interrupted tracebacks in the ranks' logs.
"""
