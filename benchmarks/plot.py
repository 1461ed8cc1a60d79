"""launch_time.png: launch time against worker count (left) and the failure timings (right).

matplotlib is a dev/bench extra: it is imported here only, when the plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import FLOOR, MULTIGPU, TORCHRUN, summarize

COLOURS = {MULTIGPU: "tab:blue", TORCHRUN: "tab:orange", FLOOR: "tab:gray"}
LABELS = {MULTIGPU: "multigpu", TORCHRUN: "torchrun", FLOOR: "ranks by hand (floor)"}


def launch_series(results: dict[str, Any]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """launcher -> [(worker count, summary)], from the launch and scale benchmarks."""
    series: dict[str, list[tuple[int, dict[str, Any]]]] = {MULTIGPU: [], TORCHRUN: [], FLOOR: []}
    for n, by in results.get("launch", {}).get("samples_s", {}).items():
        for k in series:
            series[k].append((int(n), summarize(by[k])))
    for n, by in results.get("scale", {}).get("raw", {}).items():
        for k in (MULTIGPU, TORCHRUN):
            series[k].append((int(n), summarize([r["seconds"] for r in by[k]])))
    return series


def failure_cases(results: dict[str, Any]) -> list[tuple[str, dict[str, list[float | None]], float]]:
    """(label, launcher -> seconds per run, the bound a 'never' is drawn at)."""
    cases = []
    for case, by in results.get("death", {}).get("raw", {}).items():
        mode, n = case.split("/")
        secs = {k: [r["seconds"] for r in v] for k, v in by.items()}
        cases.append((f"rank {mode}\n{n} workers", secs, 15.0))
    sk = results.get("sigkill")
    if sk:
        cases.append(
            ("launcher\nSIGKILL", {k: [r["seconds"] for r in v] for k, v in sk["raw"].items()}, sk["bound_s"])
        )
    for name, by in results.get("signals", {}).get("raw", {}).items():
        cases.append(
            (
                f"launcher\n{name}",
                {k: [r.get("gone_s") for r in v] for k, v in by.items()},
                results["signals"]["bound_s"],
            )
        )
    return cases


def _errbar(s: dict[str, Any]) -> tuple[float, float, float]:
    return s["median"], s["median"] - s["min"], s["max"] - s["median"]


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def draw_launch(ax: Any, results: dict[str, Any]) -> None:
    for k, points in launch_series(results).items():
        points = sorted((n, s) for n, s in points if "median" in s)
        if not points:
            continue
        xs = [n for n, _ in points]
        med, lo, hi = zip(*(_errbar(s) for _, s in points), strict=True)
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, color=COLOURS[k], label=LABELS[k])
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
    ax.set_xlabel("CPU workers")
    ax.set_ylabel("whole-job wall time (s), median and min-max")
    ax.set_title("Tiny gloo job: launch to exit")
    ax.grid(alpha=0.3)
    _legend(ax)


def draw_failures(ax: Any, results: dict[str, Any]) -> None:
    cases = failure_cases(results)
    width = 0.38
    for j, k in enumerate((MULTIGPU, TORCHRUN)):
        label: str | None = LABELS[k]
        for i, (_, by, bound) in enumerate(cases):
            s = summarize(by.get(k, []))
            x = i + (j - 0.5) * width
            if "median" not in s:
                ax.bar(x, bound, width, color="none", edgecolor=COLOURS[k], hatch="//")
                ax.text(
                    x, bound / 2, f"never (> {bound:g} s)", ha="center", va="center", fontsize=7, rotation=90
                )
                continue
            med, lo, hi = _errbar(s)
            ax.bar(x, med, width, yerr=[[lo], [hi]], capsize=2, color=COLOURS[k], label=label)
            label = None
    ax.set_xticks(range(len(cases)), labels=[c[0] for c in cases], fontsize=7)
    ax.set_ylabel("seconds until every process is gone")
    ax.set_title("Failure handling (hatched: never, drawn at the bound)")
    ax.grid(axis="y", alpha=0.3)
    _legend(ax)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    draw_launch(left, results)
    draw_failures(right, results)
    machine = results.get("machine", {})
    fig.suptitle(
        f"multigpu vs torchrun: torch {machine.get('torch', '?')}, {machine.get('nproc', '?')} "
        f"cores, {machine.get('date', '')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
