"""The launcher's exit codes, in one place: what a wrapper (an sbatch script, a retry loop) may act on.

``multigpu run`` exits with

* 0 when every rank succeeded;
* the root cause's own code when a rank failed: its exit code, or 128 + N when it died of signal N
  (1 when neither is known), as a shell reports a child;
* 2 for a usage mistake (one line on stderr, nothing started);
* 1 when the rendezvous refused the job (nodes that disagree on the layout or would run different
  things: every node, the refusing and the refused, says so in one line) or the job's store was lost
  (``node 0, the store's host, ended``);
* 128 + N when the launcher itself was stopped by signal N (SIGTERM: 143); after Ctrl-C it dies of
  SIGINT, as Python does;
* ``EXIT_PREEMPTED`` (75, ``EX_TEMPFAIL``: "try again later") when a preemption warning stopped the
  run early: the job was requeued (``scontrol requeue``) or, with ``--no-requeue``, whoever started
  the launcher should start it again to resume;
* ``EXIT_CRASH_LOOP`` (76) when restarts were stopped because the same failure repeated: do not
  requeue or resubmit before the code changes;
* ``EXIT_PREFLIGHT`` (77) when ``--preflight=strict`` refused the job: a node was far slower than the
  others in the check before any rank started (every node exits so); free or replace that node. The
  slow node of an elastic round that left the job (which goes on without it) exits 77 too.

A rank may itself exit with 75 or 76; the console's last lines say which case it was.
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75
EXIT_CRASH_LOOP = 76
EXIT_PREFLIGHT = 77
