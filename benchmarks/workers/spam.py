"""Rank 0 prints LINES numbered lines as fast as print() allows; no torch in the script itself.

usage: spam.py LINES
"""

from __future__ import annotations

import sys

from _bench import mark, rank, record_pid

lines = int(sys.argv[1])
record_pid()
if rank() == 0:
    mark("spam_start")
    for i in range(lines):
        print(f"bench line {i:07d} the quick brown fox jumps over the lazy dog")
    sys.stdout.flush()
    mark("spam_end")
