"""The live status view on a terminal (rich), and the final summary table."""

from __future__ import annotations

import time
from typing import Any

from multigpu.console.ranks import PrefixedConsole
from multigpu.console.writer import ConsoleWriter, WriterFile
from multigpu.supervisor.eta import estimate, progress_text
from multigpu.supervisor.hangs.book import ProgressBook
from multigpu.supervisor.output import display_text
from multigpu.supervisor.states import RankProgress, Worker, WorkerState

_STATE_STYLE = {
    WorkerState.PENDING: "dim",
    WorkerState.RUNNING: "cyan",
    WorkerState.SUCCEEDED: "green",
    WorkerState.FAILED: "bold red",
    WorkerState.STOPPED: "yellow",
}


def _rss_mib(pid: int | None) -> str:
    if pid is None:
        return "-"
    import psutil

    try:
        return f"{psutil.Process(pid).memory_info().rss / 2**20:.0f} MiB"
    except psutil.Error:
        return "-"


def status_table(
    workers: list[Worker], title: str = "multigpu", live: bool = True, bars: dict[int, str] | None = None
) -> Any:
    from rich.table import Table
    from rich.text import Text

    now = time.monotonic()
    table = Table(title=title, title_justify="left", expand=False)
    steps = any(w.progress is not None and w.progress.step is not None for w in workers)
    columns = ["rank", "pid", "device", "state", "run time", "quiet for", "memory"]
    if steps:  # only for loops that report steps: the table stays narrow otherwise
        columns.insert(6, STEP_COLUMN)
    late = any(w.progress is not None and w.progress.late_s is not None for w in workers)
    if late:  # once collective entry times are judged (``supervisor/hangs/lateness.py``)
        columns.insert(columns.index("memory"), LATE_COLUMN)
    if bars:
        columns.append("progress")
    for col in columns:
        table.add_column(
            col,
            justify="right" if col in ("rank", "pid") else "left",
            no_wrap=col in ("progress", STEP_COLUMN),
            overflow="ellipsis",
        )
    for w in workers:
        took = (w.end_time or time.time()) - (w.start_time or time.time())
        p = w.progress
        quiet = f"{now - p.last_progress:.0f}s" if w.alive and p is not None else "-"
        cells: list[Any] = [
            str(w.rank),
            str(w.pid or "-"),
            w.spec.device,
            Text(w.state.value, style=_STATE_STYLE[w.state]),
            f"{took:.1f}s",
            quiet,
            _rss_mib(w.pid) if (live and w.alive) else "-",
        ]
        if steps:
            cells.insert(6, step_cell(p))
        if late:
            cells.insert(len(cells) - 1, late_cell(p))
        if bars:
            cells.append(Text(bars.get(w.rank, ""), no_wrap=True))
        table.add_row(*cells)
    return table


STEP_COLUMN = "step (med/max)"


def step_cell(p: RankProgress | None) -> str:
    """The last step reported, and its step interval: median/slowest over the recent steps."""
    if p is None or p.step is None:
        return "-"
    median = p.median_interval()
    if median is None:
        return str(p.step)
    return f"{p.step} ({_short(median)}/{_short(max(p.intervals))})"


LATE_COLUMN = "enters late"


def late_cell(p: RankProgress | None) -> Any:
    """How late the rank enters collectives against its node's other ranks; red for a straggler."""
    from rich.text import Text

    if p is None or p.late_s is None:
        return "-"
    text = f"{p.late_s * 1e3:+.0f}ms"
    return Text(f"{text} straggler", style="bold red") if p.straggling else text


def _short(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"


class LiveStatus:
    """A status table pinned under the scrolling log lines; refreshed at most twice a second.

    A rank's progress bar (an unfinished ``\r`` line) is drawn in place in the table's progress
    column, never as a line per update. Everything goes through the console writer.
    """

    def __init__(self, title: str, console: PrefixedConsole, writer: ConsoleWriter | None = None) -> None:
        from rich.console import Console
        from rich.live import Live

        self.workers: list[Worker] = []
        self.book: ProgressBook | None = None
        """The attempt's progress book: the job's step and ETA in the title (``supervisor/eta.py``)."""
        self.title = title
        self._prefixed = console
        self.bars: dict[int, str] = {}
        self.console = Console(file=WriterFile(writer, 2), force_terminal=True)  # type: ignore[arg-type]
        self._live = Live(
            status_table(self.workers, title),
            console=self.console,
            auto_refresh=False,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    def __enter__(self) -> LiveStatus:
        self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.stop()

    def refresh(self) -> None:
        self._live.update(status_table(self.workers, self.heading(), bars=self.bars), refresh=True)

    def heading(self) -> str:
        """The title, and the job's progress once a rank reported a step (``step 120/1000 (12%)``)."""
        book = self.book
        if book is None:
            return self.title
        progress = progress_text(*estimate(list(book.ranks.values()), book.total_steps))
        return f"{self.title}: {progress}" if progress else self.title

    def write_partial(self, worker: Worker, stream: str, text: bytes) -> None:
        if self._prefixed.shows(worker.rank):
            self.bars[worker.rank] = display_text(text).decode(errors="replace")
            self.refresh()

    def write_lines(self, worker: Worker, stream: str, lines: list[bytes]) -> None:
        if not self._prefixed.shows(worker.rank):
            return
        self.bars.pop(worker.rank, None)
        prefix = self._prefixed.prefix(worker)
        text = "\n".join((prefix + line).decode(errors="replace") for line in lines)
        self._live.console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def print_summary_table(workers: list[Worker], writer: ConsoleWriter | None = None) -> None:
    from rich.console import Console

    console = Console(file=WriterFile(writer, 2), force_terminal=writer is not None)  # type: ignore[arg-type]
    console.print(status_table(workers, "multigpu summary", live=False))
