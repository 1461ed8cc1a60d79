"""The launcher's handle on the node's sentinel, one small process that ends every rank's tree if the
launcher dies. Runs in the launcher; the sentinel process itself is ``rank/sentinel.py``.

``NodeSentinel`` starts it (``python -m multigpu.rank.sentinel``, its own session, nothing but the
standard library and psutil imported), hands it each rank's pidfd as the rank starts, and ends it
when the launcher is done with it (SIGKILL and reap: it holds nothing a user needs).

Why a process: a rank's own guard (``rank/guard.py``: a pidfd thread and, across ``exec``, the
kernel's parent-death signal) cannot act while the rank is stopped (SIGSTOP) or holds the GIL in a
long C call, and a parent-death signal would end the rank without its children. Why one per node:
each rank used to fork a sentinel of its own, two forks of a process with torch loaded (about 30 ms
of CPU a rank: two seconds of a 64-rank start on two cores). This one costs one small interpreter
start, made while the template imports torch.

"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

from multigpu.contract.warm import Warm


class NodeSentinel:
    """The launcher's handle on its sentinel process; runs in the launcher."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [sys.executable, "-m", "multigpu.rank.sentinel", str(theirs.fileno()), str(os.getpid())]
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._channel = ours

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def watch(self, pid: int, pidfd: int) -> bool:
        """Hand the sentinel one rank (its pid and a pidfd for it); False if it cannot take it, and the
        rank must then guard itself."""
        if self._process is None:
            return False
        try:
            socket.send_fds(self._channel, [str(pid).encode()], [pidfd])
        except OSError:
            return False
        return True

    def close(self) -> None:
        """End the sentinel (it holds nothing a user needs) and reap it."""
        process, self._process = self._process, None
        self._channel.close()
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()


_shared: Warm[NodeSentinel] = Warm(NodeSentinel.close)


def node_sentinel() -> NodeSentinel | None:
    """This launcher's sentinel, started on first use; None where it cannot start (the ranks then
    guard themselves, as before)."""
    try:
        return _shared.get_or_start(NodeSentinel)
    except OSError:
        return None


def close_node_sentinel() -> None:
    _shared.close()
