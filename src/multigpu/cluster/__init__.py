"""Where we run: the node's GPUs (``devices``, without torch or a CUDA context), its NUMA layout
(``numa``), and the scheduler (``slurm``: the layout from ``srun``; ``requeue``: SLURM's preemption and
requeue). Runs in the launcher (and ``devices`` in function mode's caller); imports ``contract`` and
``config`` only.
"""
