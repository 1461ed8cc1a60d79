"""``--metrics-port`` and ``TORCHELASTIC_HEALTH_CHECK_PORT`` on a real 2-rank CPU job.

``/metrics`` serves every family, parsed by prometheus_client's own parser, each rank's step
increasing between two scrapes; ``/healthz`` answers 200 while both ranks step and 503 naming rank 1
once rank 1 stops stepping under ``--hang-timeout 8``, before or when the launcher acts; once the job
ends, both ports refuse connections and no rank is left. Function mode serves too
(``multigpu.launch(..., metrics_port=)``). Every wait polls for its condition, bounded."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import PYTHON, assert_gone, clean_env, free_port, start_cli, write_script
from multigpu.observe.metrics import FAMILIES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

STEPPER = """
import os, sys, time, multigpu
rank, stop, stall = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
step = 0
while not os.path.exists(stop):
    if rank == 1 and os.path.exists(stall):
        time.sleep(600)  # rank 1 stops stepping: a hang for the launcher, a 503 for /healthz
    multigpu.heartbeat(step=step)
    if step == 5:
        open(f"{stop}.{rank}", "w").close()  # the test waits for both ranks' steps to be known
    step += 1
    time.sleep(0.05)
"""


def until(what: Callable[[], object], deadline: float, why: str, pause: float = 0.1) -> object:
    """``what()`` once it is truthy, polled every ``pause`` seconds until ``deadline`` (monotonic)."""
    while not (got := what()):
        assert time.monotonic() < deadline, why
        time.sleep(pause)
    return got


def get(url: str) -> tuple[int, str]:
    """(HTTP status, body) of ``url``; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
    except urllib.error.URLError as exc:
        return isinstance(exc.reason, ConnectionRefusedError)
    return False


def steps_of(text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == "multigpu_rank_step":
            return {s.labels["rank"]: s.value for s in family.samples}
    return {}


def launcher_line(proc: subprocess.Popen[str], pattern: str) -> re.Match[str]:
    """The launcher's line matching ``pattern`` (its first lines, read until that one)."""
    assert proc.stderr is not None
    seen = []
    while (match := re.search(pattern, seen[-1] if seen else "")) is None:
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)
    return match


def rank_pids(out: Path) -> list[int]:
    record = json.loads((out / "run.json").read_text())
    return [r["pid"] for a in record["attempts"] for r in a["ranks"].values()]


def test_every_family_is_served_steps_increase_and_the_port_closes(tmp_path: Path) -> None:
    job = write_script(tmp_path, "job.py", STEPPER)
    stop, out = tmp_path / "stop", tmp_path / "out"
    argv = ["run", "--cpu", "2", "--status", "off", "--output", str(out), "--metrics-port", "0"]
    launcher = start_cli([*argv, str(job), str(stop), str(tmp_path / "never")], cwd=tmp_path)
    try:
        url = launcher_line(launcher, r"metrics: (http://127\.0\.0\.1:\d+/metrics)").group(1)
        deadline = time.monotonic() + 60
        first = until(lambda: len(s := steps_of(get(url)[1])) == 2 and s, deadline, "no steps scraped")
        text = get(url)[1]
        names = {f.name for f in text_string_to_metric_families(text)}
        assert set(FAMILIES) <= names, sorted(set(FAMILIES) - names)
        assert re.search(r'multigpu_up\{node="0",run_id="[\w-]+"\} 1\.0', text), text
        assert isinstance(first, dict)
        until(
            lambda: all(v > first[r] for r, v in steps_of(get(url)[1]).items()),
            deadline,
            f"the steps did not increase from {first}",
        )
        stop.touch()
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 0, err
    finally:
        stop.touch()
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()
    assert refused(url)
    assert_gone(rank_pids(out))


def test_healthz_is_200_then_503_naming_rank_1_when_it_stops_stepping(tmp_path: Path) -> None:
    job = write_script(tmp_path, "job.py", STEPPER)
    stop, stall, out = tmp_path / "stop", tmp_path / "stall", tmp_path / "out"
    port = free_port()
    argv = ["run", "--cpu", "2", "--status", "off", "--output", str(out), "--hang-timeout", "8"]
    launcher = start_cli(
        [*argv, "--grace-period", "1", str(job), str(stop), str(stall)],
        cwd=tmp_path,
        env={"TORCHELASTIC_HEALTH_CHECK_PORT": str(port)},
    )
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        launcher_line(launcher, rf"health check: http://127\.0\.0\.1:{port}/healthz")
        deadline = time.monotonic() + 60
        until(lambda: Path(f"{stop}.0").exists() and Path(f"{stop}.1").exists(), deadline, "no steps")
        assert get(url) == (200, "ok\n")
        stall.touch()
        # no pause: the launcher acts on the hang at the same timeout, and closes the port soon after
        got = until(lambda: (answer := get(url))[0] == 503 and answer, deadline, "never 503", pause=0)
        assert isinstance(got, tuple) and got[1].startswith("rank 1 "), got
        _, err = launcher.communicate(timeout=60)  # read: the hang's stack dumps fill a pipe
        assert launcher.returncode != 0 and "hang" in err, err  # the launcher judged the hang
    finally:
        stop.touch()
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()
    assert refused(url)
    assert_gone(rank_pids(out))


LAUNCH = """
import sys, urllib.request, multigpu

def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()

port = int(sys.argv[1])
texts = multigpu.launch(scrape, port, nprocs=2, device="cpu", metrics_port=port, output=sys.argv[2])
print("served" if all("multigpu_rank_step" in t and "multigpu_up{" in t for t in texts) else texts)
"""


def test_function_mode_serves_metrics_port(tmp_path: Path) -> None:
    script = write_script(tmp_path, "launch.py", LAUNCH)
    port = free_port()
    done = subprocess.run(
        [PYTHON, str(script), str(port), str(tmp_path / "out")],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0 and done.stdout.strip() == "served", done.stdout + done.stderr
    assert f"metrics: http://127.0.0.1:{port}/metrics" in done.stderr
    assert refused(f"http://127.0.0.1:{port}/metrics")
