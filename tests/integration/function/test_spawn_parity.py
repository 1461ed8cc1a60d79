"""``multigpu.spawn`` against ``torch.multiprocessing.spawn``: one corpus of rank behaviours, run under both.

The same script runs each behaviour (return, raise a built-in, a custom or an unpicklable exception,
``sys.exit(0)``, ``sys.exit()``, ``sys.exit(3)``, ``os._exit(4)``, SIGKILL or SIGTERM to itself, one
process, a ``start_method`` other than spawn, ``join=False`` with ``pids()``/``processes``/``join()``;
four processes and a hang stopped through ``join(timeout)`` and ``processes[0].kill()`` in the heavy
tier) once with torch's ``spawn`` (its processes forked, as the heavy tier's run shows changes nothing
but the time) and once with multigpu's, each in a fresh interpreter, and prints
what the caller saw: the exception's class, ``error_index``, ``exit_code``, ``signal_name``, the
message's shape (its header and last line, the script's own frames by file, line and function), and
whether ``error_pid`` is the process that failed. Both must print the same. Every rank is gone after.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, write_script

pytestmark = pytest.mark.integration

CORPUS = """
    import json, os, re, signal, sys, time, warnings
    from pathlib import Path

    MODE, CASES, PIDS = sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])


    class Custom(Exception):
        pass


    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("cannot pickle this")


    def misbehave(i, how, bad, folder):
        (Path(folder) / str(os.getpid())).touch()
        if how == "hang":
            time.sleep(300)
        if i != bad:
            return "fine"
        if how == "raise":
            raise ValueError("boom")
        if how == "custom":
            raise Custom("custom boom")
        if how == "unpicklable":
            raise Unpicklable("cannot come back")
        if how == "exit0":
            sys.exit(0)
        if how == "exit_none":
            sys.exit()
        if how == "exit3":
            sys.exit(3)
        if how == "os_exit4":
            os._exit(4)
        if how in ("sigkill", "sigterm"):
            os.kill(os.getpid(), getattr(signal, how.upper()))
            time.sleep(30)
        return "fine"


    def shape(exc, folder):
        msg = getattr(exc, "msg", str(exc))
        out = {"class": type(exc).__name__}
        for name in ("error_index", "exit_code", "signal_name"):
            out[name] = getattr(exc, name, None)
        out["pid_is_the_process"] = (folder / str(getattr(exc, "error_pid", 0))).exists()
        if "Traceback" in msg:
            out["header"] = msg.split("Traceback")[0]
            out["last_line"] = msg.rstrip().splitlines()[-1].replace("__mp_main__.", "")
            out["frames"] = re.findall(r'File "([^"]*corpus[.]py)", line ([0-9]+), in ([a-z_]+)', msg)
        else:
            out["msg"] = msg
        return out


    def caught(call, folder):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                out = {"class": None, "value": call()}
            except Exception as exc:
                out = shape(exc, folder)
        out["warnings"] = [str(w.message) for w in seen if "start_method" in str(w.message)]
        return out


    def without_join(spawn, folder):
        ctx = spawn(misbehave, args=("return", -1, str(folder)), nprocs=2, join=False)
        pids = ctx.pids()
        while not ctx.join():
            pass
        started = sorted(int(p.name) for p in folder.iterdir())
        return {"pids": sorted(pids) == started, "processes": [p.pid for p in ctx.processes] == pids,
                "alive": [p.is_alive() for p in ctx.processes],
                "exitcode": [p.exitcode for p in ctx.processes], "again": ctx.join()}


    def hang(spawn, folder):
        ctx = spawn(misbehave, args=("hang", -1, str(folder)), nprocs=2, join=False)
        deadline = time.monotonic() + 60
        while len(list(folder.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # each process has reached the function: it hangs there
        out = {"first_join": ctx.join(timeout=0.5), "alive": [p.is_alive() for p in ctx.processes]}
        ctx.processes[0].kill()
        try:
            while not ctx.join():
                pass
        except Exception as exc:
            out.update(shape(exc, folder))
        return out


    def run(spawn, case, folder):
        if case == "no_join":
            return without_join(spawn, folder)
        if case == "hang":
            return hang(spawn, folder)
        nprocs, how, bad, method = {
            "nprocs1": (1, "exit3", 0, "spawn"),
            "nprocs4": (4, "raise", 3, "spawn"),
            "fork": (2, "return", 1, "fork"),
            "forkserver": (2, "raise", 1, "forkserver"),
        }.get(case, (2, case, 1, "spawn"))
        args = (how, bad, str(folder))
        return caught(lambda: spawn(misbehave, args=args, nprocs=nprocs, start_method=method), folder)


    def torchs_spawn_forking():
        # torch's spawn whole (its warning, context, join and errors), its processes forked from this
        # one, which imported torch, rather than started fresh to import it again (seconds each)
        import torch.multiprocessing

        torch_spawn = sys.modules["torch.multiprocessing.spawn"]  # the module: its spawn shadows it

        start = torch_spawn.start_processes
        torch_spawn.start_processes = lambda *args, start_method: start(*args, start_method="fork")
        return torch_spawn.spawn


    if __name__ == "__main__":
        if MODE == "torch":
            from torch.multiprocessing import spawn
        elif MODE == "torch-fork":
            spawn = torchs_spawn_forking()
        else:
            from multigpu import spawn
        results = {}
        for case in CASES:
            folder = PIDS / case
            folder.mkdir()
            results[case] = run(spawn, case, folder)
        print("RESULT " + json.dumps(results), flush=True)
"""

CASES = [
    "return",
    "raise",
    "custom",
    "unpicklable",
    "exit0",
    "exit_none",
    "exit3",
    "os_exit4",
    "sigkill",
    "sigterm",
    "nprocs1",
    "fork",
    "forkserver",
    "no_join",
]
HEAVY_CASES = ["nprocs4", "hang"]


def _both(
    tmp_path: Path, cases: list[str], reference: str = "torch-fork"
) -> tuple[dict[str, object], dict[str, object]]:
    """What the caller saw in each case, under torch's spawn (``reference``: "torch" as it is,
    "torch-fork" its processes forked) and under multigpu's, run side by side."""
    script = write_script(tmp_path, "corpus.py", CORPUS)
    procs = {}
    for mode in (reference, "multigpu"):
        pids = tmp_path / f"pids_{mode}"
        pids.mkdir()
        procs[mode] = subprocess.Popen(
            [PYTHON, str(script), mode, ",".join(cases), str(pids)],
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    outputs = {mode: proc.communicate(timeout=300)[0] for mode, proc in procs.items()}
    results = {}
    for mode, out in outputs.items():
        assert procs[mode].returncode == 0, out
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        assert line is not None, out
        results[mode] = json.loads(line[len("RESULT ") :])
    started = [int(p.name) for p in tmp_path.glob("pids_*/*/*")]
    assert_gone(started)
    return results[reference], results["multigpu"]


def _compare(torchs: dict[str, object], ours: dict[str, object], cases: list[str]) -> None:
    for case in cases:
        assert ours[case] == torchs[case], f"{case}: torch {torchs[case]!r}, multigpu {ours[case]!r}"


def test_spawn_gives_what_torchs_spawn_gives(tmp_path: Path) -> None:
    torchs, ours = _both(tmp_path, CASES)
    _compare(torchs, ours, CASES)
    # the corpus is what it says: each behaviour reached the caller as torch defines it
    assert torchs["exit3"]["class"] == "ProcessExitedException" and torchs["exit3"]["exit_code"] == 3
    assert torchs["exit0"]["class"] is None and torchs["raise"]["class"] == "ProcessRaisedException"
    assert torchs["raise"]["frames"] and torchs["sigkill"]["signal_name"] == "SIGKILL"
    assert torchs["fork"]["warnings"] and torchs["no_join"]["pids"] is True


@pytest.mark.matrix
def test_spawn_with_four_processes_and_a_hang_gives_what_torchs_gives(tmp_path: Path) -> None:
    """With torch's spawn as it is (fresh interpreters, seconds each): the heavy cases, and a few of
    the others to show that forking torch's processes above changed nothing the caller sees."""
    cases = [*HEAVY_CASES, "raise", "unpicklable", "exit3", "sigterm", "no_join"]
    torchs, ours = _both(tmp_path, cases, reference="torch")
    _compare(torchs, ours, cases)
    assert torchs["hang"]["first_join"] is False and torchs["hang"]["signal_name"] == "SIGKILL"
