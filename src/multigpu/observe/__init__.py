"""What a monitoring system may ask the launcher while the job runs: Prometheus's ``/metrics``
(``--metrics-port``: ``metrics``) and torchrun's health check (``TORCHELASTIC_HEALTH_CHECK_PORT``:
``health``), both read from ``watched`` (what the launcher already knows), both opened and closed with
the run by ``serving``. Runs in the launcher, on the servers' own threads: a scrape never waits on the
supervisor's loop, and the loop never waits on a scrape.
"""
