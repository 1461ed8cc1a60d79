"""Every rank prints LINES lines of WIDTH characters at once, each line naming its rank and number,
so the harness can count the lines that reached the console whole.

usage: long_lines.py LINES WIDTH
"""

from __future__ import annotations

import sys

from _bench import rank, record_pid

lines, width = int(sys.argv[1]), int(sys.argv[2])
record_pid()
me = rank()
for i in range(lines):
    head = f"R{me}:{i:06d}:"
    print(head + "x" * (width - len(head)))
sys.stdout.flush()
