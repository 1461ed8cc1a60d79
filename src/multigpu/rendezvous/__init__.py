"""How nodes meet and share a fate, on torch's c10d store: runs in the launcher (and in function mode's
caller); ``store`` is also used by the template process, which serves a node's store.

``store`` binds, serves and connects the c10d TCPStore; ``job`` is the launchers' shared view of a job
of several nodes (membership, run id, beats, the abort record); ``failure_sharing`` and ``latency`` share one
node's failure with every node; ``elastic`` is membership on torch's own dynamic rendezvous.
"""
