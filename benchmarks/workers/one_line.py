"""A rank that prints one line and exits, importing nothing: the launcher's own cost per rank, with
nothing of the job's to hide it (the 32- and 64-rank cases of the scale benchmark)."""

import os

print("rank", os.environ["RANK"], flush=True)
