"""The template's control channel: JSON messages with descriptors on a ``SOCK_SEQPACKET`` socket pair.

Both ends use it: the launcher (``client.py``) and the template process (``server.py``). Each message
is one packet, so a message is never split or merged; descriptors travel with it (SCM_RIGHTS).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

MAX_MESSAGE = 1 << 20


MAX_FDS = 64


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and its descriptors; (None, []) at the end of the channel."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    message: dict[str, Any] = json.loads(data)
    return message, fds
