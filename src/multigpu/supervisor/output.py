"""The output path: the workers' pipes, split into lines, into their log files and onto the console.

The supervisor owns process lifetimes; this module owns every byte the workers write. Two rules shape it:

* The supervisor's loop never waits on output. Reads are non-blocking; the console is written by
  ``console.ConsoleWriter``, a bounded buffer drained by its own thread, so a paused pager, a
  closed descriptor or a hung-up terminal costs console lines (counted, and said once), never failure
  detection or teardown.
* Log files get exactly the bytes the rank wrote. The rank's combined log receives whole lines (its
  stdout and stderr are interleaved line by line, never mid-line); the per-stream files of
  ``WorkerSpec.stream_files`` (torchrun's ``--log-dir`` files) receive each read as it arrives. A full
  disk loses bytes, never the run: the loss is counted per file and said once. A line longer than
  ``LINE_CAP`` is passed on in pieces (the console and the report see pieces; the combined log gets
  every byte, though the other stream's lines may land between two pieces), so memory stays bounded.

Carriage-return progress bars (tqdm) have no newline until they end; the last ``\\r`` segment of an
unfinished line goes to the sink as a *partial* line at most every ``PARTIAL_INTERVAL`` seconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from multigpu.console.folding import CppStacks, InterruptTracebacks, PeerLostTracebacks
from multigpu.console.writer import Console
from multigpu.supervisor.events import Events
from multigpu.supervisor.log_file import LogFile

if TYPE_CHECKING:
    from multigpu.supervisor.states import Worker

logger = logging.getLogger(__name__)

READ_SIZE = 1 << 16
DRAIN_READS = 16
"""Reads of ``READ_SIZE`` per pipe in one drain: 1 MiB, the most a Linux pipe holds unless raised."""
LINE_CAP = 2 << 20
"""The longest line passed on whole; a longer one is passed on in pieces this long (said once per rank):
the launcher's memory stays bounded (a rank writing 100 MB with no newline took it past 400 MiB), the
console gets pieces its buffer (``console.writer.CAPACITY``, twice this) can hold, and the log keeps
every byte. A 1 MiB line (a dumped array) still arrives whole (``integration/cli/test_sessions.py``)."""
TAIL_LINE_CHARS = 4000
"""A tail line (for the report) is cut to this many characters; the log keeps the whole line."""
PARTIAL_INTERVAL = 0.1
SHOW_CPP_STACKS_ENV = "TORCH_SHOW_CPP_STACKTRACES"


class OutputSink(Protocol):
    """Where whole lines from the workers go besides their log files (the console, a status view)."""

    def write_lines(self, worker: Worker, stream: str, lines: list[bytes]) -> None: ...


class PartialSink(Protocol):
    """A sink that can also show an unfinished line (a progress bar), replacing the previous one."""

    def write_partial(self, worker: Worker, stream: str, text: bytes) -> None: ...


def display_text(line: bytes) -> bytes:
    """What a terminal would leave of ``line``: its last non-empty carriage-return segment."""
    if b"\r" not in line:
        return line
    for segment in reversed(line.split(b"\r")):
        if segment:
            return segment
    return b""


class Stream:
    """One pipe of one worker: the unfinished line, the files that take its bytes, its progress bar."""

    __slots__ = (
        "cpp_stacks",
        "fd",
        "files",
        "interrupts",
        "name",
        "partial_due",
        "partial_shown",
        "peer_lost",
        "pending",
        "pipe",
        "worker",
    )

    def __init__(self, worker: Worker, name: str, pipe: IO[bytes], files: list[LogFile]) -> None:
        self.worker, self.name, self.pipe = worker, name, pipe
        self.fd = pipe.fileno()
        self.files = files
        self.pending = bytearray()
        self.partial_shown = b""
        self.partial_due: float | None = None
        self.interrupts: InterruptTracebacks | None = None
        """Set once the user's Ctrl-C reached the ranks (``WorkerOutput.hide_interrupts``)."""
        self.peer_lost: PeerLostTracebacks | None = None
        """A job of several nodes: set from the start (``WorkerOutput.hold_peer_losses``)."""
        asked = os.environ.get(SHOW_CPP_STACKS_ENV, "0") not in ("", "0")
        self.cpp_stacks = None if asked else CppStacks()
        """None where the user asked torch for C++ stacks (``TORCH_SHOW_CPP_STACKTRACES=1``): shown whole."""


class WorkerOutput:
    """Every worker's output for one supervisor: opened before spawn, read by the loop, closed at the end."""

    def __init__(
        self,
        sink: OutputSink | None,
        clock: Callable[[], float],
        console: Console | None = None,
        hold_peer_losses: bool = False,
    ) -> None:
        self._sink = sink
        self._console = console or Console()
        self._clock = clock
        self._logs: dict[int, LogFile] = {}
        self._stream_files: dict[tuple[int, str], LogFile] = {}
        self._shared: dict[Path, LogFile] = {}
        self.streams: dict[int, Stream] = {}
        self.held: list[Stream] = []
        """Pipes left unread while the console catches up (``hold``)."""
        self._split_ranks: set[int] = set()
        """Ranks already told their long lines are shown in pieces (``_split``)."""
        self.peer_held: list[Stream] | None = [] if hold_peer_losses else None
        """``hold_peer_losses`` (a job of several nodes): every pipe whose tracebacks that only say a
        peer's connection closed wait aside until the attempt's root cause is known."""

    def settle_peer_losses(self, *, fold: bool) -> None:
        """The attempt's root cause is known: ``fold`` (another node's) leaves the tracebacks put aside
        to the ranks' logs; otherwise they show now, and later ones as they come."""
        for stream in self.peer_held or []:
            assert stream.peer_lost is not None
            self.show(stream, stream.peer_lost.settle(fold=fold))

    def hide_interrupts(self) -> None:
        """The user's Ctrl-C is about to reach the ranks: their ``KeyboardInterrupt`` tracebacks go to
        their logs only from here on (``InterruptTracebacks``)."""
        for stream in self.streams.values():
            stream.interrupts = stream.interrupts or InterruptTracebacks()

    def open(self, worker: Worker) -> None:
        """Create the worker's log files (truncated: a reused output folder gets this run's bytes)."""
        spec = worker.spec
        if spec.log_path is not None:
            self._logs[worker.rank] = LogFile(spec.log_path)
        for name, path in spec.stream_files.items():
            self._stream_files[(worker.rank, name)] = LogFile(Path(path))
        for copy in spec.line_copies:
            if copy.path not in self._shared:
                self._shared[copy.path] = LogFile(copy.path)

    def attach(self, worker: Worker, pipes: Iterable[tuple[str, IO[bytes] | None]]) -> list[Stream]:
        """Take the worker's pipes; the caller registers the returned streams with its selector."""
        streams = []
        for name, pipe in pipes:
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            extra = self._stream_files.get((worker.rank, name))
            stream = Stream(worker, name, pipe, [extra] if extra else [])
            if self.peer_held is not None:
                stream.peer_lost = PeerLostTracebacks()
                self.peer_held.append(stream)
            self.streams[stream.fd] = stream
            streams.append(stream)
        return streams

    def read(self, stream: Stream) -> bool:
        """Read what is there now; False once the pipe is at its end (the stream is then closed)."""
        return self._read_once(stream) >= 0

    def drain(self, streams: Iterable[Stream]) -> None:
        """Read what the pipes hold right now, without waiting (a grandchild may keep them open), at
        most a full pipe's worth each: a rank that writes faster than this reads cannot hold it."""
        for stream in list(streams):
            for _ in range(DRAIN_READS):
                if stream.fd not in self.streams or self._read_once(stream) <= 0:
                    break

    def take(self, stream: Stream, events: Events) -> bool:
        """Read a ready pipe unless the console is full (``hold``); True when it was read. A pipe at
        its end is forgotten."""
        if self.hold(stream, events):
            return False
        if not self.read(stream):
            events.forget(stream.fd)
        return True

    def hold(self, stream: Stream, events: Events) -> bool:
        """The console's buffer is full and it is still reading: leave this pipe unread until it has
        room (the rank waits on its own write, as it would on a slow console; no line is dropped)."""
        writer = self._console.writer
        if writer is None or not writer.congested():
            return False
        events.forget(stream.fd)
        self.held.append(stream)
        writer.on_room = events.wake
        return True

    def release_held(self, events: Events) -> None:
        """Watch the held pipes again once the console has room, or has stopped reading (then its
        lines are dropped and counted rather than the ranks held for it)."""
        writer = self._console.writer
        if not self.held or (writer is not None and writer.congested()):
            return
        for stream in self.held:
            if self.streams.get(stream.fd) is stream:
                events.watch(stream.fd, "out", stream)
        self.held.clear()

    def _read_once(self, stream: Stream) -> int:
        """Bytes read: 0 when nothing is there now, -1 at the end of the pipe."""
        try:
            data = os.read(stream.fd, READ_SIZE)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if not data:
            self.end(stream)
            return -1
        stream.worker.lines.last_at = self._clock()
        for f in stream.files:
            f.write(data)
        self._take(stream, data)
        if stream.pending and stream.partial_due is None and b"\r" in stream.pending:
            stream.partial_due = self._clock()
        self._show_partial(stream, self._clock())  # this stream's bar; the loop's turn shows the others'
        return len(data)

    def _take(self, stream: Stream, data: bytes) -> None:
        """Pass on the whole lines ``data`` completes, in one batch, and hold the rest. Only ``data`` is
        searched (the held bytes have no newline), and no line is passed on longer than ``LINE_CAP``:
        the held one is split first; a line within ``data`` is shorter (``LINE_CAP >= READ_SIZE``)."""
        held = len(stream.pending)
        stream.pending += data
        first, last = data.find(b"\n"), data.rfind(b"\n")
        if first >= 0:
            first, last = first + held, last + held
            while first > LINE_CAP:
                self._split(stream)
                first, last = first - LINE_CAP, last - LINE_CAP
            chunk = bytes(stream.pending[: last + 1])
            del stream.pending[: last + 1]
            self._emit(stream, chunk)
        while len(stream.pending) > LINE_CAP:
            self._split(stream)

    def _split(self, stream: Stream) -> None:
        """The held line is longer than ``LINE_CAP``: pass its first ``LINE_CAP`` bytes on as a line
        of their own (the log gets them as written, with no newline added), said once per rank."""
        piece = bytes(stream.pending[:LINE_CAP])
        del stream.pending[:LINE_CAP]
        rank = stream.worker.rank
        if rank not in self._split_ranks:
            self._split_ranks.add(rank)
            logger.warning(
                f"rank {rank} wrote a line longer than {_size(LINE_CAP)} on its {stream.name}: it is shown"
                f" in pieces of {_size(LINE_CAP)} (its log file keeps every byte)"
            )
        self._emit(stream, piece + b"\n", logged=piece)

    def of(self, worker: Worker) -> list[Stream]:
        return [s for s in self.streams.values() if s.worker is worker]

    def end(self, stream: Stream) -> None:
        """The pipe is done: pass on an unfinished last line, close the pipe."""
        if stream.pending:
            chunk = bytes(stream.pending)
            stream.pending.clear()
            self._emit(stream, chunk + b"\n", logged=chunk)
        for fold in (stream.interrupts, stream.peer_lost):
            if fold is not None:
                self.show(stream, fold.flush())
        self.streams.pop(stream.fd, None)
        stream.pipe.close()

    def due_in(self) -> float | None:
        """Seconds until a progress bar is due on the console, for the loop's select timeout."""
        dues = [s.partial_due for s in self.streams.values() if s.partial_due is not None]
        return None if not dues else max(0.0, min(dues) - self._clock())

    def show_partials(self) -> None:
        """Hand the latest state of each unfinished progress line to the sink, rate-limited."""
        now = self._clock()
        for stream in self.streams.values():
            self._show_partial(stream, now)

    def _show_partial(self, stream: Stream, now: float) -> None:
        if stream.partial_due is None or stream.partial_due > now:
            return
        stream.partial_due = None
        text = display_text(bytes(stream.pending))
        if text and text != stream.partial_shown:
            stream.partial_shown = text
            # a PartialSink (the console, the live view) shows it; another sink gets whole lines only
            show = getattr(self._sink, "write_partial", None) if self._shows(stream) else None
            if show is not None:
                show(stream.worker, stream.name, text)
            stream.partial_due = now + PARTIAL_INTERVAL  # the next update waits its turn

    def _shows(self, stream: Stream) -> bool:
        worker = stream.worker
        shown = stream.name in worker.spec.console_streams
        return self._sink is not None and not worker.lines.muted and shown

    def _emit(self, stream: Stream, chunk: bytes, logged: bytes | None = None) -> None:
        """``chunk`` holds whole lines; the log gets ``logged`` (the bytes as written), then the sink."""
        worker = stream.worker
        log = self._logs.get(worker.rank)
        if log is not None:
            log.write(chunk if logged is None else logged)
        lines = chunk.split(b"\n")[:-1]
        for copy in worker.spec.line_copies:
            if copy.stream == stream.name and (matched := copy.matching(lines)):
                self._shared[copy.path].write(matched)
        keep = worker.lines.tail.maxlen or len(lines)
        worker.lines.tail.extend(_tail_line(line) for line in lines[-keep:])
        if worker.dumps.capture is not None:
            worker.dumps.capture.extend(line.decode(errors="replace") for line in lines)
        stream.partial_shown = b""
        for fold in (stream.cpp_stacks, stream.interrupts, stream.peer_lost):
            if fold is not None:
                lines = fold.feed(lines)
        self.show(stream, lines)

    def show(self, stream: Stream, lines: list[bytes]) -> None:
        """``lines`` of ``stream`` on the console, where it shows that stream (its log has them)."""
        if self._shows(stream) and lines:
            assert self._sink is not None
            self._sink.write_lines(stream.worker, stream.name, [display_text(line) for line in lines])

    def losses(self) -> list[str]:
        files = [*self._logs.values(), *self._stream_files.values(), *self._shared.values()]
        return [loss for f in files if (loss := f.loss()) is not None]

    def close(self) -> None:
        """The pipes and files closed, and the console writer no longer calling back into the loop."""
        writer = self._console.writer
        if writer is not None:
            writer.on_room = None
        for stream in list(self.streams.values()):
            self.end(stream)
        self.settle_peer_losses(fold=False)  # no root cause settled (a path that ends early): show them
        for f in [*self._logs.values(), *self._stream_files.values(), *self._shared.values()]:
            f.close()


def _tail_line(line: bytes) -> str:
    text = display_text(line).decode(errors="replace")
    if len(text) > TAIL_LINE_CHARS:
        return f"{text[:TAIL_LINE_CHARS]}... ({len(text) - TAIL_LINE_CHARS} more characters in the log)"
    return text


def _size(count: int) -> str:
    """``count`` bytes as the notice says them: in MiB or KiB where exact."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"


def mute_all_but(workers: Iterable[Worker], failed: Worker) -> None:
    """A rank failed (it said so, or it exited): what the others say from here on is a consequence,
    for their logs only; the report names each of them in one line."""
    for other in workers:
        other.lines.muted = other.lines.muted or (other is not failed and other.alive)
