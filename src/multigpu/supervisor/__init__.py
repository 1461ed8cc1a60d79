"""One attempt's worker lifetimes on one node: runs in the launcher, and in function mode's caller (its
watcher thread).

From the bottom: ``states`` (the vocabulary: worker and run states and their one writer,
``Worker.to``; the spec a rank starts from, its live record), ``spawning`` (how a rank comes to
exist), ``output`` and ``beat_pipe`` (every byte the ranks write, into their logs and onto the
console), ``hang`` with ``learned`` timeouts, ``stragglers``, ``culprit`` and ``jobhang``
(progress and the hang decision), ``stack_dumps`` and ``flight_record`` (what a stuck rank can
still tell), ``exits``, ``oom`` and ``outcome`` (how a rank ended, and what the attempt adds up
to), ``reaping``, ``stop_requests`` and ``teardown`` (process groups and signals at the end), and
``loop``, the ``Supervisor`` that owns them: start, poll, wait, close. It never imports what uses it
(``runner``, ``function``, ``cli``).
"""
