"""The ranks' prefixed lines on the console (``console/ranks.py``): whole lines, and a progress bar redrawn
in place."""

from __future__ import annotations

from multigpu.console.ranks import PrefixedConsole
from multigpu.console.writer import ConsoleWriter
from multigpu.supervisor.states import Worker, WorkerSpec


def test_prefixed_console_redraws_a_bar_in_place_on_a_terminal() -> None:
    class Tty(ConsoleWriter):
        def __init__(self) -> None:
            super().__init__(fds=(1, 2))
            self.ttys = {1: True, 2: True}
            self.got: list[bytes] = []

        def put(self, fd: int, data: bytes, lines: int = 1) -> None:
            self.got.append(data)

    writer = Tty()
    console = PrefixedConsole(writer=writer)
    zero = Worker(WorkerSpec(rank=0, local_rank=0, argv=[], env={}))
    one = Worker(WorkerSpec(rank=1, local_rank=1, argv=[], env={}))
    console.write_partial(zero, "stderr", b"10%")
    console.write_partial(zero, "stderr", b"20%")
    console.write_lines(one, "stderr", [b"a line from rank 1"])
    console.write_lines(zero, "stderr", [b"100%"])
    assert writer.got == [
        b"\r[rank 0] 10%\x1b[K",
        b"\r[rank 0] 20%\x1b[K",
        b"\r\x1b[K[rank 1] a line from rank 1\n\r[rank 0] 20%\x1b[K",  # above the bar, bar redrawn
        b"\r\x1b[K[rank 0] 100%\n",
    ]
