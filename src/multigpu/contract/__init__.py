"""The vocabulary every process of a job shares: runs in the launcher, in every rank, in the template and
in function mode's caller alike.

The environment a rank is started with (``names`` of its variables; ``environment``, their builder),
the signals the launcher sends and the rank arms (``signals``), the bytes on a rank's heartbeat pipe
(``beats``), the failure record a rank writes and the launcher reads (``errors.WorkerFailure``), the
flight-record dump format (``flight_dump``), the launcher's exit codes, the parsers of typed-in values
(``values``), which frames are multigpu's own (``frames``) and the ``prctl`` calls that tie process
lifetimes together (``prctl``). Standard library only, and it imports
nothing else of multigpu: everything else may import it.
"""
