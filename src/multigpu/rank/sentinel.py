"""The node's sentinel process (``python -m multigpu.rank.sentinel``): ends every rank's tree if the
launcher dies. Started by the launcher (``runner/sentinel_handle.NodeSentinel``), one per node; it runs
beside the ranks, as the out-of-process half of their guard (``guard.py``).

It holds a pidfd for the launcher and one for each rank the launcher hands it. When the launcher
dies: for every rank still alive, stop it (so it forks no more), SIGKILL its whole tree (descendants
that left its group included) and its process group, then leave. Signals go through the rank's
pidfd, so a recycled PID is never hit. When the launcher closes the channel, it is done: leave.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys

from multigpu.rank.guard import end_tree


def end_rank(pid: int, pidfd: int) -> None:
    """Stop the rank, SIGKILL its tree and its group, then the rank; runs in the sentinel."""
    if select.select([pidfd], [], [], 0)[0]:
        return  # it has exited already
    with contextlib.suppress(OSError):
        group = os.getpgid(pid)
        signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
        end_tree(pid)
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        if group == pid:  # the rank leads its own group: the group is the rank's
            os.killpg(group, signal.SIGKILL)


def receive(channel: socket.socket, ranks: dict[int, int]) -> bool:
    """Take one registration; False once the launcher closed its end (it is done with us)."""
    try:
        message, fds, _, _ = socket.recv_fds(channel, 64, 1)
    except OSError:
        return False
    if not message and not fds:
        return False
    for fd in fds:
        ranks[fd] = int(message.decode())
    for fd in [fd for fd in ranks if select.select([fd], [], [], 0)[0]]:
        os.close(fd)  # that rank has exited: forget it
        del ranks[fd]
    return True


def watch(channel: socket.socket, launcher_fd: int, ranks: dict[int, int]) -> None:
    """Take registrations until the launcher dies. Its end of the channel closing is not the end: a
    SIGKILLed launcher's descriptors close before its pidfd says it exited, and a launcher done with
    us SIGKILLs this process right after closing (``NodeSentinel.close``)."""
    listening = True
    while True:
        ready, _, _ = select.select([launcher_fd, channel.fileno()] if listening else [launcher_fd], [], [])
        if launcher_fd in ready:
            return
        listening = receive(channel, ranks)


def main(argv: list[str]) -> None:
    channel = socket.socket(fileno=int(argv[0]))
    launcher = int(argv[1])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's death or its SIGKILL end this process
    ranks: dict[int, int] = {}
    try:
        launcher_fd: int | None = os.pidfd_open(launcher)
    except OSError:
        launcher_fd = None  # it died while we started
    if launcher_fd is not None and os.getppid() == launcher:
        watch(channel, launcher_fd, ranks)
    channel.setblocking(False)
    while receive(channel, ranks):  # what it sent just before it died
        pass
    for fd, pid in ranks.items():
        end_rank(pid, fd)


if __name__ == "__main__":
    main(sys.argv[1:])
