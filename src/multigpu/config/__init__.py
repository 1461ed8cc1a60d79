"""The typed run configuration (``run.RunConfig``, grouped by concern, every default written once), and the
typed values it holds (``endpoint``, ``streams``). Runs in the launcher and in OTX's caller,
which both build one; imports only ``contract``.
"""
