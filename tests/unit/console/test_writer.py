"""The console writer (``console/writer.py``): a bounded buffer its own thread drains, never blocking the
loop; the launcher's own std descriptors."""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

import pytest

from helpers import PYTHON, clean_env
from multigpu.console.writer import ConsoleWriter

pytestmark = pytest.mark.timeout(30)


def test_console_writer_never_blocks_and_counts_what_it_dropped() -> None:
    """A pipe nobody reads: put() returns at once; once read, one notice says how many were dropped."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    writer = ConsoleWriter(capacity=64 << 10, fds=(out_w, err_w))
    try:
        with writer:
            t0 = time.monotonic()
            for i in range(20000):
                writer.put(out_w, f"line {i:05d} {'x' * 100}\n".encode())
            took = time.monotonic() - t0
            writer.put(err_w, b"stderr is not held back by stdout\n")
            got = bytearray()  # stdout stays unread until stderr's line has arrived
            deadline = time.monotonic() + 5
            while b"not held back" not in got:
                assert time.monotonic() < deadline, "stderr never written while stdout was stalled"
                if select.select([err_r], [], [], 0.1)[0]:
                    got += os.read(err_r, 65536)
            deadline = time.monotonic() + 10
            while b"line(s) dropped" not in got and time.monotonic() < deadline:
                for fd in select.select([out_r, err_r], [], [], 0.1)[0]:
                    got += os.read(fd, 1 << 20)
        print(f"20000 puts into a stalled console took {took * 1000:.1f} ms")
        assert b"console line(s) dropped" in got
    finally:
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)


def test_a_console_that_goes_away_ends_only_that_stream() -> None:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.close(out_r)  # `| head -1` has left
    writer = ConsoleWriter(fds=(out_w, err_w))
    try:
        with writer:
            writer.put(out_w, b"into a closed pipe\n")
            assert select.select([err_r], [], [], 5)[0]
            writer.put(out_w, b"more\n")
            writer.put(err_w, b"stderr still works\n")
            got = bytearray()
            deadline = time.monotonic() + 5
            while b"still works" not in got and time.monotonic() < deadline:
                if select.select([err_r], [], [], 0.1)[0]:
                    got += os.read(err_r, 65536)
        assert b"is gone" in got and b"still works" in got
        assert out_w in writer.dead
    finally:
        for fd in (out_w, err_r, err_w):
            os.close(fd)


def test_no_console_thread_outlives_its_writer() -> None:
    before = set(threading.enumerate())
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        with ConsoleWriter(fds=(fd,)) as writer:
            writer.put(fd, b"x\n")
    finally:
        os.close(fd)
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.integration
def test_ensure_std_fds_never_reuses_0_to_2(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import os, sys\nfrom multigpu.console.writer import ensure_std_fds\nensure_std_fds()\n"
        "r, w = os.pipe()\nprint(r, w, file=open('fds.txt', 'w'))\n"
    )
    for closed in ("<&-", ">&-", "2>&-", "<&- >&- 2>&-"):
        res = subprocess.run(
            ["bash", "-c", f'exec {PYTHON} -c "$0" {closed}', code],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            timeout=30,
        )
        assert res.returncode == 0, res.stderr
        assert min(int(x) for x in (tmp_path / "fds.txt").read_text().split()) > 2, closed


def test_a_console_idle_before_close_still_gets_the_last_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found under a full disk: the launcher's last lines came after a quiet spell longer than the stall
    limit, and close() took the idle console for a stalled one and dropped them."""
    from multigpu.console import writer as console

    now = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    r, w = os.pipe()
    try:
        writer = ConsoleWriter(fds=(w,))
        with writer:
            now[0] += 10 * console.STALL_S  # nothing written for a long while; the reader is fine
            writer.put(w, b"output lost: rank_0.log\n", keep=True)
        assert os.read(r, 4096) == b"output lost: rank_0.log\n"
    finally:
        os.close(r)
        os.close(w)
