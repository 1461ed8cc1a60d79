"""Hang and straggler policy: runs in the launcher (and in OTX's caller, on its watcher thread).

The supervisor's loop owns the ranks' lifetimes; this room only decides. ``book`` (the ``ProgressBook``:
each rank's steps and the hang verdict on this node) with ``learned`` timeouts kept for the next
attempt and ``hang`` (a hang's wording and the failures it makes), ``beat_pipe`` (a rank's heartbeat
pipe read into the book), ``stragglers`` and ``lateness`` (who is slow, from steps and from collective
entry times), ``verdict`` (one verdict for a job of several nodes; the store's side is
``rendezvous/hang_store.py``), and what a stuck rank can still tell: ``stack_dumps``,
``flight_record`` and the ``culprit`` named from them.
"""
