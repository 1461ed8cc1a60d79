"""Function mode (OTX's MultiGPUManager) through real processes: the test starts a script that becomes
rank 0 and spawns the others; the pytest process itself never becomes a rank."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import PYTHON, assert_gone, clean_env, pids_in, wait_for_lines, write_script

pytestmark = pytest.mark.integration

COMMON = """
    import json, os, sys, time
    from multigpu import MultiGPUManager, WorkerFailedError, is_multigpu_child_process

    OUT = os.environ["TEST_OUT"]
    MODE = os.environ.get("TEST_MODE", "ok")

    def note_pid():
        with open(os.path.join(os.environ["TEST_DIR"], "pids.txt"), "a") as f:
            f.write(f"pid={os.getpid()}\\n")
        print(f"pid={os.getpid()}", flush=True)

    def report(**extra):
        import torch.distributed as dist
        data = {"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(),
                "local_rank": int(os.environ["LOCAL_RANK"]), "device": os.environ.get("MULTIGPU_DEVICE"),
                "child": is_multigpu_child_process(), "argv": sys.argv, **extra}
        print("REPORT " + json.dumps(data) + "\\n", end="", flush=True)
"""

TRAIN = (
    COMMON
    + """
    def train():
        import torch
        import torch.distributed as dist
        note_pid()
        rank = dist.get_rank()
        if MODE == "ok":
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            report(sum=t.item())
        elif MODE == "fail":
            if rank == 2:
                raise ValueError("boom from rank 2")
            for _ in range(600):  # rank 0 and 1 keep training until they are told
                time.sleep(0.05)
        elif MODE == "hang":
            for _ in range(1200):
                time.sleep(0.05)

    if os.environ.get("RANK") == "2" and MODE == "die-before-join":  # a child, importing this script
        raise ValueError("boom from rank 2 before joining")
    if os.environ.get("RANK") == "2" and MODE == "die-in-init":
        # Rank 2 dies inside init_process_group, right after gloo published its address in the store
        # and before it connected: the caller may be waiting in gloo for rank 2's connection.
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        class DyingStore(dist.Store):
            def __init__(self, prefix, store):
                super().__init__()
                self.inner = c10d_prefix_store(prefix, store)
            def set(self, key, value):
                self.inner.set(key, value)
                with open(os.path.join(os.environ["TEST_DIR"], "died_at"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), 9)
            def __getattr__(self, name):
                return getattr(self.inner, name)
            def get(self, key):
                return self.inner.get(key)
            def add(self, key, value):
                return self.inner.add(key, value)
            def wait(self, *args):
                return self.inner.wait(*args)
            def check(self, keys):
                return self.inner.check(keys)
            def multi_get(self, keys):
                return self.inner.multi_get(keys)
            def multi_set(self, keys, values):
                return self.inner.multi_set(keys, values)

        c10d_prefix_store = c10d.PrefixStore
        c10d.PrefixStore = DyingStore

    def report_caught(exc, phase):
        caught = {"rank": exc.rank, "exit_code": exc.exit_code, "signal": exc.signal,
                  "traceback": exc.traceback, "text": str(exc), "phase": phase, "at": time.time()}
        print("CAUGHT " + json.dumps(caught) + "\\n", end="", flush=True)

    if __name__ == "__main__":
        timeout = float(os.environ.get("TEST_TIMEOUT", "0")) or None
        manager = MultiGPUManager(train, "0,1,2", device="cpu", timeout=timeout)
        assert manager.is_available()
        hpo = {"learning_rate": 0.01, "data.batch_size": 8} if MODE == "ok" else None
        try:
            out = manager.setup_multi_gpu_train(OUT, hpo)
        except WorkerFailedError as exc:  # a child failed while this process was still joining
            report_caught(exc, "setup")
            manager.finalize()  # a no-op after a failed setup
            print("FINALIZE AFTER FAILED SETUP RETURNED", flush=True)
            sys.exit(3)
        try:
            print(f"OUTPUT {out}", flush=True)
            train()
            manager.finalize()
        except WorkerFailedError as exc:
            report_caught(exc, "train")
            try:
                manager.finalize()  # the first call still reports the failure ...
            except WorkerFailedError as again:
                print(f"FINALIZE RAISED rank={again.rank}", flush=True)
            manager.finalize()  # ... and a second call is a no-op
            sys.exit(3)
        manager.finalize()  # twice is safe
        print("FINALIZED TWICE", flush=True)
"""
)


def _start(tmp_path: Path, mode: str, argv: list[str], **extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    script = write_script(tmp_path, "otx_train.py", TRAIN)
    log = tmp_path / "parent.out"
    env = clean_env(
        {"TEST_OUT": str(tmp_path / "out"), "TEST_MODE": mode, "TEST_DIR": str(tmp_path), **extra}
    )
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [PYTHON, str(script), *argv],
            cwd=tmp_path,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def _finish(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _reports(text: str) -> dict[int, dict[str, Any]]:
    found = [json.loads(m) for m in re.findall(r"REPORT (\{.*\})$", text, re.M)]
    return {r["rank"]: r for r in found}


def test_three_ranks_argv_and_hyper_parameters(tmp_path: Path) -> None:
    argv = ["--gpus", "0,1,2", "--keep", "k", "--gpus=0,1,2", "params", "--existing", "1"]
    proc, log = _start(tmp_path, "ok", argv)
    code = _finish(proc, 90)
    text = log.read_text()
    assert code == 0, text
    pids = pids_in(text)
    assert len(set(pids)) == 3 and proc.pid in pids
    assert_gone(pids)
    assert "FINALIZED TWICE" in text

    out = tmp_path / "out"
    assert f"OUTPUT {out}" in text
    assert json.loads((out / "optimized_hyper_parameters.json").read_text()) == {
        "learning_rate": 0.01,
        "data.batch_size": 8,
    }

    reports = _reports(text)
    assert sorted(reports) == [0, 1, 2], text
    for rank, r in reports.items():
        assert r["world"] == 3 and r["sum"] == 6.0
        assert r["local_rank"] == rank and r["device"] == "cpu"
        assert r["child"] is (rank != 0)
        # every rank sees all the hyper-parameters after params, as --name value
        after = r["argv"][r["argv"].index("params") + 1 :]
        assert after[:2] == ["--existing", "1"]
        assert after[2:] == ["--learning_rate", "0.01", "--data.batch_size", "8"]
    assert reports[0]["pid"] == proc.pid

    # the parent keeps its own argv (plus the hyper-parameters); children get --output and the endpoint
    # and lose --gpus in both forms
    parent = reports[0]["argv"]
    assert parent[1:] == [*argv, "--learning_rate", "0.01", "--data.batch_size", "8"]
    for rank in (1, 2):
        child = reports[rank]["argv"]
        assert not any(a == "--gpus" or a.startswith("--gpus=") for a in child), child
        assert "0,1,2" not in child
        before = child[: child.index("params")]
        assert "--keep" in before and before[before.index("--keep") + 1] == "k"
        assert before[before.index("--output") + 1] == str(out)
        endpoint = before[before.index("--rdzv-endpoint") + 1]
        assert re.fullmatch(r"127\.0\.0\.1:\d+", endpoint) and not endpoint.endswith(":0")
    assert reports[1]["argv"] == reports[2]["argv"]

    # the children's logs
    for rank in (1, 2):
        assert f"pid={reports[rank]['pid']}" in (out / "logs" / "attempt_0" / f"rank_{rank}.log").read_text()


def _watch(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, set[int]]:
    """Wait for ``proc`` and collect, by PID, every process it started while it ran."""
    import psutil

    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            seen |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        time.sleep(0.05)
    return _finish(proc, max(1.0, deadline - time.monotonic())), seen


def test_failing_child_raises_typed_error_in_parent(tmp_path: Path) -> None:
    proc, log = _start(tmp_path, "fail", [])
    code, seen = _watch(proc, 90)
    text = log.read_text()
    # A rank's pid line may never print: rank 2's error can stop the others before they get there.
    pids = set(pids_in(text)) | {proc.pid} | seen
    assert len(pids) >= 3, text
    assert_gone(pids)
    # the parent handled the error itself: not SIGKILLed, not 137
    assert code == 3, text
    caught = json.loads(re.search(r"^CAUGHT (\{.*\})$", text, re.M).group(1))  # type: ignore[union-attr]
    assert caught["rank"] == 2
    assert caught["exit_code"] == 1 and caught["signal"] is None
    assert "ValueError: boom from rank 2" in caught["traceback"]
    assert "otx_train.py" in caught["traceback"] and "Traceback" in caught["traceback"]
    assert "rank 2" in caught["text"]
    # Rank 2 may fail before the caller is out of setup (then setup raises and finalize() is a no-op),
    # or after (then train's wait raises, and finalize() reports the failure once more).
    if caught["phase"] == "setup":
        assert "FINALIZE AFTER FAILED SETUP RETURNED" in text and "FINALIZE RAISED" not in text


@pytest.mark.parametrize("mode", ["die-before-join", "die-in-init"])
def test_a_child_that_dies_while_joining_fails_setup_within_seconds(tmp_path: Path, mode: str) -> None:
    """Rank 2 dies before it joins, or inside init_process_group once gloo has published its address:
    the caller gets rank 2's failure within seconds, not after the group's timeout (600 s here; gloo
    waits 5x that for a peer that never connects).

    Dying inside init_process_group, rank 2 may already have accepted the caller's connection (the
    kernel completes it on the listening socket), so the caller's setup may succeed, and the failure
    then arrives in its training loop (train() here returns at once, so finalize() raises it)."""
    proc, log = _start(tmp_path, mode, [], TEST_TIMEOUT="600")
    code, seen = _watch(proc, 60)
    text = log.read_text()
    assert_gone({proc.pid} | seen)
    assert code == 3, text
    caught = json.loads(re.search(r"^CAUGHT (\{.*\})$", text, re.M).group(1))  # type: ignore[union-attr]
    assert caught["rank"] == 2, text
    if mode == "die-before-join":
        assert caught["phase"] == "setup" and "boom from rank 2 before joining" in caught["traceback"]
    else:
        assert caught["signal"] == "SIGKILL"
        took = caught["at"] - float((tmp_path / "died_at").read_text())
        print(f"the caller raised in {caught['phase']} {took:.2f}s after rank 2 died in init_process_group")
        assert took < 30, "bounded by the caller's connect timeout, far below 5 x 600 s"
    if caught["phase"] == "setup":
        assert "FINALIZE AFTER FAILED SETUP RETURNED" in text and "FINALIZE RAISED" not in text


def test_parent_sigkilled_children_gone(tmp_path: Path) -> None:
    proc, _ = _start(tmp_path, "hang", [])
    try:
        wait_for_lines(tmp_path / "pids.txt", r"pid=(\d+)", 3, timeout=60)
        pids = pids_in((tmp_path / "pids.txt").read_text())
        children = [p for p in pids if p != proc.pid]
        assert len(children) == 2 and proc.pid in pids
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert_gone(children, timeout=2.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


BLOCKED = (
    COMMON
    + """
    def train():
        import torch
        import torch.distributed as dist
        note_pid()
        if dist.get_rank() == 2:
            time.sleep(0.5)
            raise ValueError("boom from rank 2")
        t = torch.zeros(1)
        dist.all_reduce(t)  # ranks 0 and 1 wait here for rank 2, which never comes

    if __name__ == "__main__":
        manager = MultiGPUManager(train, "0,1,2", device="cpu")
        manager.setup_multi_gpu_train(OUT)
        try:
            train()
            manager.finalize()
        except WorkerFailedError as exc:
            print(f"CAUGHT WorkerFailedError rank={exc.rank}", flush=True)
            sys.exit(3)
        except BaseException as exc:
            print(f"CAUGHT {type(exc).__name__}", flush=True)
            sys.exit(4)
"""
)


def test_failing_child_while_parent_is_in_a_collective(tmp_path: Path) -> None:
    script = write_script(tmp_path, "blocked.py", BLOCKED)
    env = clean_env({"TEST_OUT": str(tmp_path / "out"), "TEST_DIR": str(tmp_path)})
    proc = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    pids = pids_in((tmp_path / "pids.txt").read_text())
    assert len(set(pids)) == 3
    assert_gone(pids)
    assert "CAUGHT WorkerFailedError rank=2" in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode == 3


# ---- delivery: whatever rank 0 is doing, a child's failure reaches it as WorkerFailedError --------------

DELIVERY = (
    COMMON
    + """
    import signal, traceback

    def train():
        import torch
        import torch.distributed as dist
        note_pid()
        rank = dist.get_rank()
        asleep = os.path.join(os.environ["TEST_DIR"], "rank0_asleep")
        if rank == 2:
            for _ in range(3):
                dist.all_reduce(torch.ones(4096))
            while MODE in ("sleep", "swallowed") and not os.path.exists(asleep):
                time.sleep(0.01)  # the test's ordering: fail once rank 0 is in its sleep
            if MODE == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("boom from rank 2")  # no sleep: it exits at once
        if MODE == "sleep":
            for _ in range(3):
                dist.all_reduce(torch.ones(4096))
            if rank == 0:
                open(asleep, "w").close()
            time.sleep(30)
        elif MODE == "swallowed":
            try:
                for _ in range(3):
                    dist.all_reduce(torch.ones(4096))
                if rank == 0:
                    open(asleep, "w").close()
                time.sleep(30)
            except Exception as exc:  # a user's broad handler swallows it ...
                print(f"SWALLOWED {type(exc).__name__}", flush=True)
        else:  # "collective", "killed": a long loop of all_reduce calls, left half-way by rank 2
            for _ in range(100000):
                dist.all_reduce(torch.ones(4096))

    if __name__ == "__main__":
        manager = MultiGPUManager(train, "0,1,2", device="cpu")
        manager.setup_multi_gpu_train(OUT)
        try:
            train()
            print("TRAIN RETURNED", flush=True)
            manager.finalize()  # ... and finalize() raises it again
        except WorkerFailedError as exc:
            where = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__][-1]
            caught = {"rank": exc.rank, "exit_code": exc.exit_code, "signal": exc.signal,
                      "traceback": exc.traceback, "cause": type(exc.__cause__).__name__,
                      "cause_text": str(exc.__cause__), "where": where.line}
            print("CAUGHT " + json.dumps(caught) + "\\n", end="", flush=True)
            manager.finalize()  # the error was already raised: finalize() still raises it once ...
            sys.exit(3)
"""
)


def _run_delivery(tmp_path: Path, mode: str) -> tuple[dict[str, Any], str]:
    script = write_script(tmp_path, "rank0_train.py", DELIVERY)
    env = clean_env({"TEST_OUT": str(tmp_path / "out"), "TEST_DIR": str(tmp_path), "TEST_MODE": mode})
    proc = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    pids = pids_in((tmp_path / "pids.txt").read_text())
    assert len(set(pids)) == 3
    assert_gone(pids)
    found = re.search(r"^CAUGHT (\{.*\})$", proc.stdout, re.M)
    assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(found.group(1)), proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", ["collective", "sleep"])
def test_child_failure_reaches_a_blocked_rank_0(tmp_path: Path, mode: str) -> None:
    caught, text = _run_delivery(tmp_path, mode)
    assert caught["rank"] == 2 and caught["exit_code"] == 1 and caught["signal"] is None
    assert "ValueError: boom from rank 2" in caught["traceback"]
    if mode == "collective":  # out of the user's all_reduce call, through torch's collective wrapper
        assert "all_reduce" in caught["where"]
        # Chained from the backend's error when rank 0 was already blocked inside gloo; raised by the
        # delivery signal itself (no cause) when it came while rank 0 was still in torch's Python
        # wrapper. Rank 2 fails at once, so both orders happen; either way it leaves all_reduce.
        assert caught["cause"] in ("RuntimeError", "NoneType"), caught
    else:  # out of the sleep itself, in the user's code
        assert caught["where"] == "time.sleep(30)" and caught["cause"] == "NoneType"
    assert "TRAIN RETURNED" not in text


def test_child_killed_by_a_signal_reaches_rank_0_in_a_collective(tmp_path: Path) -> None:
    caught, _ = _run_delivery(tmp_path, "killed")
    assert caught["rank"] == 2 and caught["signal"] == "SIGKILL" and caught["exit_code"] is None, caught
    # as in the collective case above: from gloo's error, or from the delivery signal when it came while
    # rank 0 was still in torch's Python wrapper; either way it leaves the user's all_reduce call
    assert caught["cause"] in ("RuntimeError", "NoneType") and "all_reduce" in caught["where"], caught


def test_swallowed_error_is_raised_again_by_finalize(tmp_path: Path) -> None:
    caught, text = _run_delivery(tmp_path, "swallowed")
    assert "SWALLOWED WorkerFailedError" in text
    assert "TRAIN RETURNED" in text
    assert caught["rank"] == 2 and "boom from rank 2" in caught["traceback"]
    assert text.index("TRAIN RETURNED") < text.index("CAUGHT ")  # raised by finalize(), after train()


# ---- setup is all-or-nothing; a crashed supervisor thread is never success ---------------------------

SETUP = (
    COMMON
    + """
    import signal, socket, threading
    import torch.distributed as dist

    if os.environ.get("LOCAL_RANK") in ("1", "2") and MODE == "child_dies":
        note_pid()
        raise ImportError("this child cannot import the training script")

    def train():
        import torch
        note_pid()
        t = torch.ones(1)
        dist.all_reduce(t)
        report(sum=t.item())

    def state():
        return {"excepthook": sys.excepthook is sys.__excepthook__,
                "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                "sigusr2": signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,
                "env": sorted(k for k in os.environ if k.startswith(("MULTIGPU_", "TORCHELASTIC_", "RANK"))),
                "argv": list(sys.argv), "threads": sorted(t.name for t in threading.enumerate()),
                "group": dist.is_initialized()}

    if __name__ == "__main__":
        before = state()
        func, out, endpoint, held = train, OUT, "localhost:0", None
        if MODE == "unpicklable":
            func = lambda: None
        elif MODE == "bad_folder":
            out = os.path.join(os.environ["TEST_DIR"], "a_file")
            open(out, "w").close()
        elif MODE == "port_taken":
            held = socket.socket()
            held.bind(("127.0.0.1", 0))
            held.listen()
            endpoint = f"127.0.0.1:{held.getsockname()[1]}"
        manager = MultiGPUManager(func, "0,1,2", endpoint, device="cpu")
        hpo = {"learning_parameters": {"learning_rate": 0.5}}
        try:
            manager.setup_multi_gpu_train(out, hpo)
        except Exception as exc:
            print(f"SETUP FAILED {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
            print(f"CAUSE {type(exc.__cause__).__name__}", flush=True)
        else:
            if MODE == "crash":
                import multigpu.console.ranks
                def broken(*args, **kwargs):
                    raise OSError(28, "No space left on device")
                multigpu.console.ranks.PrefixedConsole.write_lines = broken
            train()
        try:
            manager.finalize()
            print("FINALIZE OK", flush=True)
        except Exception as exc:
            print(f"FINALIZE RAISED {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        if MODE != "crash":
            print("RESTORED " + json.dumps(state() == before), flush=True)
            if state() != before:
                print("DIFF " + json.dumps([before, state()]), flush=True)
        if MODE == "child_dies":  # nothing was left behind: the same process can run again
            os.environ["TEST_MODE"] = "ok"
            MODE = "ok"
            again = MultiGPUManager(train, "0,1", device="cpu")
            again.setup_multi_gpu_train(OUT + "2")
            train()
            again.finalize()
            print("SECOND RUN OK", flush=True)
"""
)


def _run_setup(tmp_path: Path, mode: str) -> str:
    script = write_script(tmp_path, "setup_train.py", SETUP)
    env = clean_env({"TEST_OUT": str(tmp_path / "out"), "TEST_DIR": str(tmp_path), "TEST_MODE": mode})
    proc = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    text = proc.stdout + proc.stderr
    pids_file = tmp_path / "pids.txt"
    if pids_file.exists():
        assert_gone(pids_in(pids_file.read_text()))
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("unpicklable", "MultiGPUError: train_func cannot be sent to the child processes"),
        ("bad_folder", "UsageError: output folder"),  # a MultiGPUError, as run and launch refuse it
        ("port_taken", "RendezvousError: rendezvous address 127.0.0.1:"),
    ],
)
def test_setup_checks_fail_before_any_child_starts(tmp_path: Path, mode: str, error: str) -> None:
    text = _run_setup(tmp_path, mode)
    assert f"SETUP FAILED {error}" in text, text[-3000:]
    assert not (tmp_path / "pids.txt").exists()  # no child ever ran
    assert "FINALIZE OK" in text  # finalize() after a failed setup is a no-op
    assert "RESTORED true" in text, text[-3000:]  # argv, handlers, excepthook, environment, threads


def test_setup_that_fails_after_children_started_undoes_everything(tmp_path: Path) -> None:
    text = _run_setup(tmp_path, "child_dies")
    # rank 0 was waiting for children that died importing the script: in the count of joined ranks
    # (the error is raised there, with no cause), or in the store, whose connection was cut short
    assert "SETUP FAILED WorkerFailedError: rank " in text, text[-3000:]
    assert re.search(r"^CAUSE (NoneType|RuntimeError|Dist\w*Error)$", text, re.M), text[-3000:]
    assert len(set(pids_in((tmp_path / "pids.txt").read_text()))) >= 2
    assert "FINALIZE OK" in text and "RESTORED true" in text, text[-3000:]
    assert "SECOND RUN OK" in text, text[-3000:]


def test_crashed_supervisor_thread_makes_finalize_raise(tmp_path: Path) -> None:
    text = _run_setup(tmp_path, "crash")
    assert "the supervisor thread crashed" in text, text[-3000:]
    assert "FINALIZE RAISED MultiGPUError: multigpu's supervisor thread crashed" in text, text[-3000:]
    assert "FINALIZE OK" not in text
