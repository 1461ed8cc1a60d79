"""One attempt's worker lifetimes on one node: runs in the launcher, and in OTX's caller (its
watcher thread).

From the bottom: ``states`` (the vocabulary: worker and run states and their one writer,
``Worker.to``; the spec a rank starts from, its live record), ``spawning`` (how a rank comes to
exist), ``output`` (every byte the ranks write, into their logs and onto the console), ``exits``,
``oom`` and ``outcome`` (how a rank ended, and what the attempt adds up to), ``reaping``,
``stop_requests`` and ``teardown`` (process groups and signals at the end), and ``loop``, the
``Supervisor`` that owns them: start, turn, wait, close. The policy that decides a rank is hung or
slow lives in ``hangs/``, a room of its own that the loop consults. It never imports what uses it
(``runner``, ``function``, ``otx``, ``cli``).
"""
