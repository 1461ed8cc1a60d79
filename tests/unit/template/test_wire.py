"""The template's channel (``template/wire.py``): one JSON message per packet with its descriptors beside
it, messages never merged, and the end of the channel read as ``(None, [])``. No processes."""

from __future__ import annotations

import os
import socket

from multigpu.template import wire


def test_a_message_and_its_descriptors_cross_whole_and_the_end_reads_as_none() -> None:
    launcher, template = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    wire.send(launcher, {"op": "spawn", "rank": 3}, [w])
    wire.send(launcher, {"op": "ping"})
    os.close(w)
    message, fds = wire.receive(template)
    assert message == {"op": "spawn", "rank": 3} and len(fds) == 1
    os.write(fds[0], b"through")
    os.close(fds[0])
    assert os.read(r, 16) == b"through"
    assert wire.receive(template) == ({"op": "ping"}, [])
    launcher.close()
    assert wire.receive(template) == (None, [])
    template.close()
    os.close(r)
