"""Issue 33's benchmark: ``multigpu.launch`` beside ``torch.multiprocessing.spawn`` (and Accelerate's
``notebook_launcher`` where it is installed), from one Python caller, the same function, N CPU ranks.

``benchmarks/notebook_launch.py [--nprocs 2,4] [--runs 3] [--out DIR]``. Each run is a fresh caller process
that imports torch first (a notebook has), then measures, in that process:

- ``first``: the first launch; ``second``: a second launch in the same process, 2 s later (a notebook's
  next cell); ``at once``: a third, right after the second ends (a loop of launches: HPO, tests);
- ``exception``: from a rank's ``raise`` (the rank writes the time to a file first) to the caller's
  ``except``;
- ``plain``: one Python process that imports torch and runs the same function once (the floor the first
  launch is held to).

Targets (issue 33): the second 4-rank launch at most 0.3x ``mp.spawn``'s time; the first at most 1.25x
``plain``; an exception reaches the caller within 0.2 s. The function is a gloo ``all_reduce`` of a small
tensor. ``notebook_launcher`` gets a free port (its default, 29500, would collide with other runs); it
is measured where ``import accelerate`` works (``pip install -e '.[bench]'``; Accelerate needs NumPy,
so where it is on the path every caller here runs with NumPy too). Prints a markdown table and writes
it, with the raw samples, into ``--out`` (default a scratch folder). Runs in the harness; a run is
bounded at 300 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CALLER = textwrap.dedent(r"""
    import json, os, sys, time
    import torch
    import torch.distributed as dist

    KIND, N = sys.argv[1], int(sys.argv[2])

    def work(i=None, *rest):
        dist.init_process_group("gloo")
        t = torch.ones(4) * dist.get_rank()
        dist.all_reduce(t)
        dist.destroy_process_group()
        return float(t[0])

    def fail(i=None, *rest):
        if int(os.environ.get("RANK", i or 0)) == N - 1:
            with open("raised_at.partial", "w") as f:
                f.write(repr(time.time()))
            os.replace("raised_at.partial", "raised_at")
            raise ValueError("the last rank fails")
        time.sleep(60)

    def with_env(i, n, port):  # mp.spawn gives no torchrun environment
        os.environ.update(RANK=str(i), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return work()

    def free_port():
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def once():
        started = time.monotonic()
        if KIND == "multigpu":
            import multigpu
            multigpu.launch(work, nprocs=N, device="cpu")
        elif KIND == "mp.spawn":
            import torch.multiprocessing as mp
            mp.spawn(with_env, args=(N, free_port()), nprocs=N)
        else:
            from accelerate import notebook_launcher
            notebook_launcher(work, num_processes=N, use_port=str(free_port()))
        return time.monotonic() - started

    def exception():
        if os.path.exists("raised_at"):
            os.unlink("raised_at")
        try:
            if KIND == "multigpu":
                import multigpu
                multigpu.launch(fail, nprocs=N, device="cpu")
            elif KIND == "mp.spawn":
                import torch.multiprocessing as mp
                mp.spawn(fail, nprocs=N)
            else:
                from accelerate import notebook_launcher
                notebook_launcher(fail, num_processes=N, use_port=str(free_port()))
        except Exception:
            caught = time.time()
            with open("raised_at") as f:
                return caught - float(f.read())  # the rank's time.time() just before its raise
        return None

    if __name__ == "__main__":
        out = {"first": once()}
        time.sleep(2)
        out["second"] = once()
        out["at_once"] = once()
        out["exception"] = exception()
        print("RESULT " + json.dumps(out), flush=True)
""")

PLAIN = "import time; t = time.monotonic(); import torch; torch.ones(4).sum(); print(time.monotonic() - t)"


def measure(kind: str, nprocs: int, cwd: Path) -> dict[str, float | None]:
    script = cwd / "caller.py"  # a file: mp.spawn's children re-import the caller's __main__
    script.write_text(CALLER)
    proc = subprocess.run(
        [sys.executable, str(script), kind, str(nprocs)], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"{kind} x{nprocs} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def plain() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", PLAIN], check=True, capture_output=True)
    return time.monotonic() - started


def accelerate_installed() -> bool:
    return subprocess.run([sys.executable, "-c", "import accelerate"], capture_output=True).returncode == 0


def median(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    out = options.out or Path(tempfile.mkdtemp(prefix="notebook-launch-"))
    out.mkdir(parents=True, exist_ok=True)
    kinds = ["multigpu", "mp.spawn"] + (["notebook_launcher"] if accelerate_installed() else [])
    samples: dict[str, list[dict[str, float | None]]] = {}
    floor = [plain() for _ in range(options.runs)]
    for n in (int(x) for x in options.nprocs.split(",")):
        for run in range(options.runs):
            for kind in kinds[run % len(kinds) :] + kinds[: run % len(kinds)]:  # rotated: drift is shared
                samples.setdefault(f"{kind} x{n}", []).append(measure(kind, n, out))
    rows = [
        "| caller | first launch (s) | second launch (s) | at once (s) | exception to except (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    summary = {}
    for name, runs in samples.items():
        summary[name] = {k: median([r[k] for r in runs]) for k in ("first", "second", "at_once", "exception")}
        cells = [f"{v:.3f}" if v is not None else "-" for v in summary[name].values()]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    rows.append(f"| plain `python -c 'import torch; ...'` | {median(floor):.3f} | | | |")  # type: ignore[str-format]
    if "notebook_launcher" not in kinds:
        rows.append("\nAccelerate is not installed here: `notebook_launcher` was not measured.")
    table = "\n".join(rows)
    print(table)
    (out / "notebook_launch.md").write_text(table + "\n")
    (out / "notebook_launch.json").write_text(
        json.dumps({"samples": samples, "plain": floor, "summary": summary}, indent=2)
    )
    print(f"written to {out}")


if __name__ == "__main__":
    main()
