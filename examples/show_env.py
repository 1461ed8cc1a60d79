"""Print what the launcher put in this rank's environment."""

import os

keys = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
)
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
