"""``multigpu.launch`` and ``multigpu.spawn`` from a script, with 2 CPU ranks forked from the template.

The test writes a script and runs it in a fresh interpreter (the pytest process never launches): module
functions by reference, ``__main__`` functions and lambdas by value, values in rank order, a rank's own
exception caught by its type with the remote traceback as ``__cause__``, and PyTorch's DDP tutorial
(CPU form) under ``multigpu.spawn`` with nothing changed but the import. Every rank is gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, free_port, write_script

pytestmark = pytest.mark.integration

HELPER_MODULE = """
    import os

    def rank_times(x):
        return int(os.environ["RANK"]) * x
"""

LAUNCHES = """
    import json, os, sys, time
    import multigpu
    from helpermod import rank_times

    class Refused(KeyError):
        pass

    def fail(kind):
        if os.environ["RANK"] == "1":
            raise Refused("custom") if kind == "custom" else ValueError("rank one says no")
        time.sleep(60)

    out = {}
    out["module"] = multigpu.launch(rank_times, 10, nprocs=2, device="cpu")
    offset = 5
    out["lambda"] = multigpu.launch(lambda a, b=0: (int(os.environ["RANK"]), a + b + offset), 1, nprocs=2,
                                    device="cpu", kwargs={"b": 2})
    started = time.monotonic()
    try:
        multigpu.launch(fail, "value", nprocs=2, device="cpu", grace_period=2)
    except ValueError as exc:
        out["value_error"] = {"text": str(exc), "notes": exc.__notes__, "cause": str(exc.__cause__),
                              "seconds": time.monotonic() - started}
    try:
        multigpu.launch(fail, "custom", nprocs=2, device="cpu", grace_period=2)
    except Refused as exc:
        out["custom"] = type(exc).__name__
    try:
        multigpu.launch(os._exit, 3, nprocs=2, device="cpu")
    except multigpu.WorkerFailedError as exc:
        out["exited"] = exc.exit_code

    def leave(code):
        if os.environ["RANK"] == "1":
            sys.exit(code)
        return "stayed"

    out["exit0"] = multigpu.launch(leave, 0, nprocs=2, device="cpu")
    try:
        multigpu.launch(leave, 3, nprocs=2, device="cpu")
    except Exception as exc:  # an Exception, never a SystemExit here
        out["exit3"] = [type(exc).__name__, exc.rank, exc.exit_code, str(exc)]

    def refuse_here():
        raise ValueError("this value cannot be read by the caller")

    class OnlyInTheRank:
        def __reduce__(self):
            return refuse_here, ()  # called where it is unpickled: the caller

    def unreadable():
        return OnlyInTheRank() if os.environ["RANK"] == "1" else 0

    try:
        multigpu.launch(unreadable, nprocs=2, device="cpu")
    except multigpu.MultiGPUError as exc:
        out["unreadable"] = str(exc)
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_launch_returns_values_and_raises_the_ranks_own_exception(tmp_path: Path) -> None:
    write_script(tmp_path, "helpermod.py", HELPER_MODULE)
    script = write_script(tmp_path, "launches.py", LAUNCHES)
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [PYTHON, str(script)],
        cwd=tmp_path,
        env=clean_env({"XDG_CACHE_HOME": str(cache)}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["module"] == [0, 10]
    assert out["lambda"] == [[0, 8], [1, 8]]
    error = out["value_error"]
    assert error["text"] == "rank one says no"
    assert len(error["notes"]) == 1 and error["notes"][0].startswith("multigpu: raised by rank 1 (pid ")
    assert "Traceback (most recent call last)" in error["cause"] and "in fail" in error["cause"]
    assert "ValueError: rank one says no" in error["cause"]
    line = (
        script.read_text()
        .splitlines()
        .index('        raise Refused("custom") if kind == "custom" else ValueError("rank one says no")')
        + 1
    )
    assert f'File "{script}", line {line}, in fail' in error["cause"]  # the script's, not <dynamic-code>
    assert error["seconds"] < 60  # rank 0 sleeps 60 s: it was stopped, not waited for
    assert out["custom"] == "Refused"
    assert out["exited"] == 3
    assert out["exit0"] == ["stayed", None]  # sys.exit(0): a rank that returned None
    kind, rank, code, text = out["exit3"]
    assert (kind, rank, code) == ("WorkerFailedError", 1, 3) and "rank 1 " in text and "code 3" in text
    assert out["unreadable"] == (
        "multigpu.launch: rank 1's return value cannot be read here: "
        "ValueError: this value cannot be read by the caller"
    )
    assert "[rank 1] " in proc.stdout + proc.stderr  # the ranks' lines reached the caller's streams
    assert not (tmp_path / "multigpu_runs").exists()  # the records are in the cache folder
    runs = sorted((cache / "multigpu" / "runs").iterdir())
    assert len(runs) == 8
    pids = []
    for run in runs:
        record = json.loads((run / "run.json").read_text())
        pids += [r["pid"] for a in record["attempts"] for r in a["ranks"].values() if r.get("pid")]
        assert not (run / ".multigpu").exists()  # the payload is removed after each launch
    assert pids
    assert_gone(pids)


DDP_TUTORIAL = """
    import os
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.optim as optim
    import multigpu as mp  # the only change: was ``import torch.multiprocessing as mp``

    from torch.nn.parallel import DistributedDataParallel as DDP

    PORT = sys.argv[1]  # the tutorial's fixed 12355, made free so parallel tests do not collide


    def setup(rank, world_size):
        os.environ['MASTER_ADDR'] = 'localhost'
        os.environ['MASTER_PORT'] = PORT

        # initialize the process group
        dist.init_process_group("gloo", rank=rank, world_size=world_size)


    def cleanup():
        dist.destroy_process_group()


    class ToyModel(nn.Module):
        def __init__(self):
            super(ToyModel, self).__init__()
            self.net1 = nn.Linear(10, 10)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 5)

        def forward(self, x):
            return self.net2(self.relu(self.net1(x)))


    def demo_basic(rank, world_size):
        print(f"Running basic DDP example on rank {rank}.")
        setup(rank, world_size)

        model = ToyModel()
        ddp_model = DDP(model)

        loss_fn = nn.MSELoss()
        optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()

        cleanup()
        print(f"Finished running basic DDP example on rank {rank}.")


    def run_demo(demo_fn, world_size):
        mp.spawn(demo_fn,
                 args=(world_size,),
                 nprocs=world_size,
                 join=True)


    def demo_fails(rank, world_size):
        if rank == 1:
            raise KeyError("rank 1 fails")


    if __name__ == "__main__":
        run_demo(demo_basic, 2)
        try:
            run_demo(demo_fails, 2)
        except mp.ProcessRaisedException as exc:
            print(f"RAISED index={exc.error_index} cause={type(exc.__cause__).__name__}", flush=True)
"""


def test_spawn_runs_the_cpu_ddp_tutorial_unchanged_but_for_the_import(tmp_path: Path) -> None:
    script = write_script(tmp_path, "ddp_tutorial.py", DDP_TUTORIAL)
    proc = subprocess.run(
        [PYTHON, str(script), str(free_port())],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for rank in (0, 1):
        assert f"Finished running basic DDP example on rank {rank}." in text
    assert "RAISED index=1 cause=KeyError" in text


WARM = """
    import json, os, threading, time
    import multigpu
    from multigpu.function import launcher_handle

    def launcher_pid(pause=0.0):
        time.sleep(pause)
        return int(os.environ["MULTIGPU_LAUNCHER_PID"])

    def of_template(p):
        try:
            return "multigpu.template" in " ".join(p.cmdline())
        except Exception:  # psutil.Error: a rank or middle process that has just ended
            return False

    def template_pid():  # the oldest process of the launcher's that runs the template (forks keep its name)
        import psutil
        launcher = psutil.Process(launcher_pid())
        return min((p for p in launcher.children() if of_template(p)), key=lambda p: p.create_time()).pid

    out = {"first": multigpu.launch(launcher_pid, nprocs=2, device="cpu")}
    out["templates"] = [multigpu.launch(template_pid, nprocs=2, device="cpu") for _ in range(2)]
    os.environ["MULTIGPU_TEST_CHANGED"] = "1"  # torch may read any variable at import: a new template
    out["templates"].append(multigpu.launch(template_pid, nprocs=2, device="cpu"))
    started = time.monotonic()
    out["second"] = multigpu.launch(launcher_pid, nprocs=2, device="cpu")  # right after: kept template
    out["second_s"] = time.monotonic() - started
    busy = threading.Thread(target=lambda: out.update(busy=multigpu.launch(launcher_pid, 3.0, nprocs=1,
                                                                            device="cpu")))
    busy.start()
    time.sleep(0.5)
    out["beside"] = multigpu.launch(launcher_pid, nprocs=1, device="cpu")  # the warm one is busy
    busy.join()
    shared = launcher_handle._shared.held()
    multigpu.shutdown()
    out["after_shutdown"] = shared.process.poll()
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_the_launcher_stays_warm_and_shutdown_ends_it(tmp_path: Path) -> None:
    script = write_script(tmp_path, "warm.py", WARM)
    proc = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    first, second = out["first"], out["second"]
    assert len(set(first)) == 1 and first == second and out["busy"] == first[:1]  # one launcher, 3 launches
    assert out["beside"] != first  # a launch made while it was busy got a launcher of its own
    assert out["after_shutdown"] == 0
    kept, again, changed = out["templates"]
    assert len(set(kept)) == 1 and again == kept  # back to back: the same template forked both launches
    assert len(set(changed)) == 1 and changed != kept  # the caller's environment changed: a fresh one
    assert "plain processes" not in proc.stderr  # every rank was forked from a template
    print(f"a launch right after another (2 CPU ranks, warm launcher and template): {out['second_s']:.2f}s")
    assert_gone([first[0], out["beside"][0], kept[0], changed[0]])


TEN = """
    import glob, json, os, signal, sys, tempfile, threading, time
    import psutil
    import multigpu

    def ok(x):
        return int(os.environ["RANK"]) + x

    def fail():
        if os.environ["RANK"] == "1":
            raise ValueError("rank one says no")
        time.sleep(60)

    def too_large():  # the limit lowered in this rank only, to prove the error without 2 GiB
        import multigpu.function.rank_call as rank_call
        rank_call.RESULT_LIMIT_BYTES = 1000
        return b"x" * (10 if os.environ["RANK"] == "0" else 5000)

    def nap():
        open(f"napping_{os.environ['RANK']}", "w").close()
        time.sleep(300)

    def hello():
        print(f"hello from rank {os.environ['RANK']} in a thread", flush=True)
        return 1

    def interrupt_when_napping():
        while len(glob.glob("napping_*")) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # a kernel interrupt, as the stop button sends it

    def state():
        me = psutil.Process()
        kids = sorted(" ".join(p.cmdline()[1:3]) for p in me.children(recursive=True))
        fds = sorted(os.listdir("/proc/self/fd"))
        temp = sorted(glob.glob(os.path.join(tempfile.gettempdir(), "multigpu-*")))
        return {"threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")),
                "fds": fds, "children": kids, "temp": temp}

    out = {"before": state(), "caught": []}
    def launch(fn, *args, **options):
        try:
            return multigpu.launch(fn, *args, nprocs=2, device="cpu", grace_period=2, **options)
        except BaseException as exc:
            out["caught"].append(f"{type(exc).__name__}: {exc}")

    out["values"] = [launch(ok, 1)]
    out["warm"] = state()  # the launcher and its template are warm from here on
    out["values"].append(launch(fail))
    out["values"].append(launch(os._exit, 3))
    out["values"].append(launch(too_large))
    waker = threading.Thread(target=interrupt_when_napping)
    waker.start()
    out["values"].append(launch(nap))
    waker.join()
    out["values"].append(launch(ok, 2))
    background = {}
    thread = threading.Thread(target=lambda: background.update(v=launch(hello)))
    thread.start()
    thread.join()
    out["values"].append(background["v"])
    out["values"].append(launch(lambda: os.environ["WORLD_SIZE"]))
    out["values"].append(launch(fail))
    out["values"].append(launch(ok, 3))
    out["after"] = state()
    multigpu.shutdown()
    out["shut"] = state()
    print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_ten_launches_with_failures_and_an_interrupt_leave_nothing_behind(tmp_path: Path) -> None:
    temp, work, cache = tmp_path / "tmp", tmp_path / "work", tmp_path / "cache"
    temp.mkdir()
    work.mkdir()
    script = write_script(tmp_path, "ten.py", TEN)
    proc = subprocess.run(
        [PYTHON, str(script)],
        cwd=work,
        env=clean_env({"TMPDIR": str(temp), "XDG_CACHE_HOME": str(cache)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    values, caught = out["values"], out["caught"]
    assert values == [[1, 2], None, None, None, None, [2, 3], [1, 1], ["2", "2"], None, [3, 4]], out
    assert caught[0] == caught[4] == "ValueError: rank one says no", caught
    assert caught[1].startswith("WorkerFailedError: ") and "exit" in caught[1], caught
    assert (
        caught[2].startswith("ValueError: rank 1's return value is 5") and "limit of 1000 bytes" in caught[2]
    )
    assert caught[3] == "KeyboardInterrupt: ", caught
    # a launch from a background thread: its ranks' lines reach the caller's stdout too
    assert "[rank 1] hello from rank 1 in a thread" in proc.stdout, text[-4000:]
    before, warm, after, shut = out["before"], out["warm"], out["after"], out["shut"]
    # after ten launches, the same as after the first: the warm launcher and one template, nothing more
    assert after["children"] == warm["children"] and len(warm["children"]) == 2, (warm, after)
    assert (after["threads"], after["tasks"], len(after["fds"])) == (
        warm["threads"],
        warm["tasks"],
        len(warm["fds"]),
    )
    # and once shut down, the same as before any launch
    assert shut["children"] == [] and shut["fds"] == before["fds"], (before, shut)
    assert (shut["threads"], shut["tasks"]) == (before["threads"], before["tasks"])
    assert shut["temp"] == [] and list(temp.glob("multigpu-*")) == []
    assert sorted(os.listdir(work)) == ["napping_0", "napping_1"]  # nap()'s own: no record here
    runs = sorted((cache / "multigpu" / "runs").iterdir())
    assert len(runs) == 10 and not [r for r in runs if (r / ".multigpu").exists()]  # no payload left
    pids = []
    for run in runs:
        record = json.loads((run / "run.json").read_text())
        pids += [r["pid"] for a in record["attempts"] for r in a["ranks"].values() if r.get("pid")]
    assert_gone(pids)


HISTORY = """
    import os
    import multigpu
    import multigpu.function.run_history as run_history

    run_history.KEEP_RUNS = 3  # an HPO loop's 1,000 trials, in small
    for trial in range(6):
        assert multigpu.launch(lambda: trial, nprocs=2, device="cpu", run_id=f"trial-{trial}") == [trial] * 2
    print("RESULT done", flush=True)
"""


def test_a_loop_of_launches_keeps_a_bounded_history_out_of_the_working_folder(tmp_path: Path) -> None:
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    script = write_script(tmp_path, "history.py", HISTORY)
    proc = subprocess.run(
        [PYTHON, str(script)],
        cwd=work,
        env=clean_env({"XDG_CACHE_HOME": str(cache)}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and "RESULT done" in proc.stdout, proc.stdout + proc.stderr
    assert os.listdir(work) == []
    runs = cache / "multigpu" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["trial-3", "trial-4", "trial-5"]
    assert runs.stat().st_mode & 0o777 == 0o700
    pids = [
        r["pid"]
        for run in runs.iterdir()
        for a in json.loads((run / "run.json").read_text())["attempts"]
        for r in a["ranks"].values()
    ]
    assert len(pids) == 6
    assert_gone(pids)


SHARED_OUTPUT = """
    import json, os, sys, threading, time
    from pathlib import Path
    import multigpu

    out_dir, open_dir = Path(sys.argv[1]), Path(sys.argv[2])
    started, release = out_dir.parent / "started", out_dir.parent / "release"

    def hold():
        started.touch()
        deadline = time.monotonic() + 60
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return int(os.environ["RANK"])

    def deadline_wait(path):
        deadline = time.monotonic() + 120
        while not path.exists():
            assert time.monotonic() < deadline, "the first launch never started"
            time.sleep(0.05)

    out = {}
    first = threading.Thread(target=lambda: out.update(first=multigpu.launch(hold, nprocs=1, device="cpu",
                                                                             output=out_dir)))
    first.start()
    deadline_wait(started)
    out["before"] = sorted(p.name for p in out_dir.rglob("*"))
    try:
        multigpu.launch(int, nprocs=1, device="cpu", output=out_dir)
    except multigpu.MultiGPUError as exc:
        out["second"] = str(exc)
    out["after"] = sorted(p.name for p in out_dir.rglob("*"))
    release.touch()
    first.join()
    try:
        multigpu.launch(int, nprocs=1, device="cpu", output=open_dir / "a" / "run")
    except multigpu.MultiGPUError as exc:
        out["open"] = str(exc)
    multigpu.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_launch_leaves_the_run_folder_to_the_launcher(tmp_path: Path) -> None:
    """A second launch given a live run's ``output`` is refused without touching that run's files; a
    folder inside one every user may write to is refused before anything is created in it; the payload
    lives in a private folder that is gone afterwards."""
    temp, open_dir = tmp_path / "tmp", tmp_path / "open"
    temp.mkdir()
    open_dir.mkdir()
    open_dir.chmod(0o777)  # writable by all, no sticky bit: another user could plant links in it
    script = write_script(tmp_path, "shared.py", SHARED_OUTPUT)
    proc = subprocess.run(
        [PYTHON, str(script), str(tmp_path / "run"), str(open_dir)],
        cwd=tmp_path,
        env=clean_env({"TMPDIR": str(temp)}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert out["first"] == [0]
    assert "before any rank reported" in out["second"] and "is in use by run" in text, text[-4000:]
    assert out["after"] == out["before"] and ".multigpu" not in out["before"], out
    assert "before any rank reported" in out["open"] and "writable by every user" in text, text[-4000:]
    assert list(open_dir.iterdir()) == []
    assert list(temp.glob("multigpu-*")) == []


SHUTDOWN_WHILE_BUSY = """
    import json, os, sys, threading, time
    from pathlib import Path
    import multigpu

    started = Path(sys.argv[1]) / "started"

    def hold():
        Path(started).write_text(str(os.getpid()))
        time.sleep(45)

    out = {}

    def background():
        try:
            multigpu.launch(hold, nprocs=1, device="cpu")
        except BaseException as exc:
            out["raised"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=background)
    thread.start()
    deadline = time.monotonic() + 120
    while not started.exists():
        assert time.monotonic() < deadline, "the launch never started"
        time.sleep(0.05)
    began = time.monotonic()
    multigpu.shutdown()  # from another thread than the launch's: kills it, never closes its pipes
    out["shutdown_s"] = time.monotonic() - began
    thread.join(60)
    out["alive"] = thread.is_alive()
    out["rank"] = int(started.read_text())
    out["fds"] = len(os.listdir("/proc/self/fd"))
    out["after"] = multigpu.launch(int, "7", nprocs=1, device="cpu")  # a new launcher serves
    multigpu.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_shutdown_from_another_thread_kills_a_busy_launcher_and_leaves_its_pipes(tmp_path: Path) -> None:
    script = write_script(tmp_path, "busy.py", SHUTDOWN_WHILE_BUSY)
    proc = subprocess.run(
        [PYTHON, str(script), str(tmp_path)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert out["shutdown_s"] < 10, out  # not the launch's 45 s, nor the 30 s wait for an idle launcher
    assert not out["alive"] and out["raised"].startswith("MultiGPUError: "), out
    assert "Bad file descriptor" not in text and "Traceback" not in text, text[-4000:]
    assert out["after"] == [7]
    assert_gone([out["rank"]])


MANY_FDS = """
    import json, os, resource
    import multigpu

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = []
    while not held or held[-1] < 1100:  # every descriptor the launcher's pipes may get is past 1024
        held.append(os.open(os.devnull, os.O_RDONLY))
    out = {"values": multigpu.launch(int, "3", nprocs=2, device="cpu")}
    multigpu.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_launch_works_with_descriptors_past_1024_open(tmp_path: Path) -> None:
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the hard open-file limit is below 1200")
    script = write_script(tmp_path, "fds.py", MANY_FDS)
    proc = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert '"values": [3, 3]' in proc.stdout
