"""The run's record: ``run.json`` (``run_json``) and its timeline of ``incidents``, the output ``folder``,
the ``failure_report`` said on the console and kept in the record, and ``multigpu report``'s
``report_page``. Runs in the launcher (and OTX's caller), which writes the record, and in
the shell of whoever reads it later (``multigpu report``, ``status``, ``stacks``).
"""
