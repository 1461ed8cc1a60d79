"""One attempt's worker lifetimes on one node: runs in the launcher, and in function mode's caller (its
watcher thread).

From the bottom: ``states`` (the vocabulary: worker and run states, the spec a rank starts from, its
live record), ``spawning`` (how a rank comes to exist), ``output`` and ``console`` (every byte the
ranks write, and a console the loop never waits on), ``hang`` (progress and the hang decision),
``dumps`` and ``flight_record`` (what a stuck rank can still tell), ``reaping`` and ``signals``
(process groups and signals at teardown), and ``loop``, the ``Supervisor`` that owns them: start,
poll, wait, close. It never imports what uses it (``launch``, ``function``, ``cli``).
"""
