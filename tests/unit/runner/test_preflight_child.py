"""The check's process as the launcher sees it (``runner/preflight_child.py``): both pipes read to their
ends, the read bounded, and the process ended as a rank is (SIGTERM to its group, one deadline, SIGKILL,
reaped), with a plain Python child standing in for the check."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import psutil
import pytest

from helpers import assert_gone
from multigpu.contract.preflight_wire import PreflightTask
from multigpu.runner.preflight_child import collect, end, start
from multigpu.supervisor.spawning import PopenSpawner
from multigpu.supervisor.states import ProcessHandle, WorkerSpec

pytestmark = pytest.mark.timeout(60)


def child(code: str) -> ProcessHandle:
    argv = [sys.executable, "-c", code]
    return PopenSpawner().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), dict(os.environ), ())


def test_both_pipes_are_read_to_their_end_and_the_process_reaped() -> None:
    handle = child("import sys; sys.stderr.write('e' * 200000); print('done')")
    out, err = collect(handle, time.monotonic() + 30)
    end(handle)
    assert out == b"done\n" and len(err) == 200000 and handle.returncode == 0


def test_a_check_past_its_deadline_is_ended_with_its_group_by_sigterm() -> None:
    handle = child(
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"
    )
    with pytest.raises(TimeoutError):
        collect(handle, time.monotonic() + 1.0)
    pids = [p.pid for p in psutil.Process(handle.pid).children(recursive=True)]
    end(handle)
    assert handle.returncode == -signal.SIGTERM
    assert_gone([handle.pid, *pids])


def test_a_check_that_ignores_sigterm_is_killed_at_the_deadline_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handle = child(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
        "time.sleep(60)"
    )
    assert handle.stdout is not None and handle.stdout.readline() == b"up\n"
    with caplog.at_level(logging.WARNING):
        end(handle, grace=0.2)
    assert handle.returncode == -signal.SIGKILL
    assert [r.getMessage() for r in caplog.records] == [
        f"the preflight check (pid {handle.pid}): still running 0.2s after SIGTERM; sending SIGKILL"
    ]
    assert_gone([handle.pid])


def test_a_check_that_ended_is_reaped_and_nothing_signalled(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = child("pass")
    handle.wait()
    sent: list[tuple[int, int]] = []

    def signal(target: int, sig: int) -> None:  # the group is gone: a probe finds nothing, a signal is kept
        if sig == 0:
            raise ProcessLookupError(target)
        sent.append((target, sig))

    monkeypatch.setattr(os, "killpg", signal)
    monkeypatch.setattr(os, "kill", signal)
    end(handle)  # its group is empty: its id is never signalled again
    end(handle)  # safe twice
    assert handle.returncode == 0 and caplog.records == [] and sent == []


def test_the_check_is_started_with_its_task_as_its_one_argument() -> None:
    task = PreflightTask("127.0.0.1", 1, "multigpu/r/preflight/0", 1, 2, "cpu", 60.0, os.getpid())
    seen: list[WorkerSpec] = []

    class Keeping(PopenSpawner):
        def spawn(self, spec: WorkerSpec, env: dict[str, str], pass_fds: tuple[int, ...]) -> ProcessHandle:
            seen.append(spec)
            argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])", *spec.argv[3:]]
            return super().spawn(WorkerSpec(rank=-1, local_rank=-1, argv=argv, env={}), env, ())

    handle = start(task, dict(os.environ), Keeping())
    out, _ = collect(handle, time.monotonic() + 30)
    end(handle)
    assert seen[0].argv[:3] == [sys.executable, "-m", "multigpu.preflight"]
    assert PreflightTask.decode(seen[0].argv[3]) == task
    assert json.loads(seen[0].argv[3])["node"] == 1 and out.startswith(b"['{")
