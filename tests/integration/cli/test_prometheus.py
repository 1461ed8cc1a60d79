"""A real Prometheus server (Debian's ``prometheus``) scrapes a running 2-rank job's ``--metrics-port``
every second, and its query API returns ``multigpu_rank_step`` for each rank.

The heavy tier (``scripts/fault_matrix.sh``): Prometheus starts in a few seconds and keeps a TSDB in
tmp. It listens on loopback only, is ended by its PID, and nothing is left. Missing ``prometheus`` skips
in one line, and fails under CI=true (``.ci/run`` installs it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import assert_gone, free_port, start_cli, tier_cannot_run, write_script
from integration.cli.test_metrics_port import STEPPER, launcher_line, rank_pids, until

pytestmark = [pytest.mark.integration, pytest.mark.matrix, pytest.mark.timeout(120)]

CONFIG = """global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: multigpu
    static_configs:
      - targets: ["{target}"]
"""


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """(the path of its configuration, written once the launcher's port is known, and its query API's
    base address); the test starts the server itself then."""
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        tier_cannot_run("no prometheus here (Debian: apt-get install prometheus)")
    yield tmp_path / "prometheus.yml", f"http://127.0.0.1:{free_port()}"


def query(api: str, expr: str) -> list[dict[str, object]]:
    """The instant vector Prometheus answers ``expr`` with; empty while it cannot answer yet."""
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return list(json.loads(reply.read())["data"]["result"])
    except OSError:
        return []


def test_prometheus_scrapes_every_ranks_step(tmp_path: Path, prometheus: tuple[Path, str]) -> None:
    config, api = prometheus
    job = write_script(tmp_path, "job.py", STEPPER)
    stop, out = tmp_path / "stop", tmp_path / "out"
    argv = ["run", "--cpu", "2", "--status", "off", "--output", str(out), "--metrics-port", "0"]
    launcher = start_cli([*argv, str(job), str(stop), str(tmp_path / "never")], cwd=tmp_path)
    server = None
    try:
        target = launcher_line(launcher, r"metrics: http://(127\.0\.0\.1:\d+)/metrics").group(1)
        config.write_text(CONFIG.format(target=target))
        server = subprocess.Popen(
            [
                shutil.which("prometheus") or "/usr/bin/prometheus",
                f"--config.file={config}",
                f"--web.listen-address={api.removeprefix('http://')}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
        )
        deadline = time.monotonic() + 60
        found = until(
            lambda: len(got := query(api, "multigpu_rank_step")) == 2 and got, deadline, "no samples"
        )
        assert isinstance(found, list)
        assert sorted(r["metric"]["rank"] for r in found) == ["0", "1"]  # type: ignore[index]
        up = query(api, 'multigpu_up{job="multigpu"}')
        assert up and up[0]["value"][1] == "1"  # type: ignore[index]
    finally:
        stop.touch()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        launcher.communicate(timeout=30)
    assert launcher.returncode == 0
    assert_gone([*rank_pids(out), *([server.pid] if server is not None else [])])
