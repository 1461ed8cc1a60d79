"""``--debug-server``'s token stays with its user, tried as a real second local user would (issue 43).

The job's TCPStore has no authentication and its port is in the world-readable run.json, so another
user can read every key in it; the run folder's logs are readable by every user too. Neither may hold
the token (which opens every rank's stacks), nor the request log of the page its owner opened; and the
other user gets no stacks, from the page or from any address the store names, and what they write in
the store is shown to the owner as text, never run as the page's script. The owner's own page still
shows every rank.
"""

from __future__ import annotations

import json
import pwd
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, free_port, pids_in, start_cli, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.xdist_group("second_user")]

JOB = """
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"pid={os.getpid()}", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    dist.barrier()
"""

SNOOP = """
import encodings.idna, json, os, sys, urllib.error, urllib.request  # idna: urlopen imports it late
from datetime import timedelta
import torch.distributed as dist  # imported as root: the test's interpreter is under /root
os.setgroups([])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[1]))  # from here on this process is the second user, to the kernel too
out, page = sys.argv[3], sys.argv[4]
seen = {}
for folder, _, names in os.walk(out):
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                seen[path] = f.read().decode("latin-1")
        except OSError as exc:
            seen[path] = f"unreadable: {type(exc).__name__}"
attempt = json.loads(seen[os.path.join(out, "run.json")])["attempts"][-1]
store = dist.TCPStore(
    attempt["master_addr"], attempt["master_port"], is_master=False, timeout=timedelta(seconds=10)
)
keys = store.list_keys()
for key, value in zip(keys, store.multi_get(keys)):
    seen["store:" + key] = value.decode("latin-1")
store.set("planted-by-another-user", "<script>steal()</script>")  # for the owner's page to show

def ask(url, post):
    try:
        request = urllib.request.Request(url, data=b"" if post else None)
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except Exception as exc:
        return type(exc).__name__

answers = {page + "/stacks": ask(page + "/stacks", False)}
for key, value in seen.items():
    if key.startswith("store:debug_server/") and value.startswith("http"):
        answers[value + "/handler/dump_traceback"] = ask(value + "/handler/dump_traceback", True)
        guess = page + "/stacks?token=" + value.rstrip("/").rsplit("/", 1)[-1]
        answers[guess] = ask(guess, False)
print(json.dumps({"seen": seen, "answers": answers}))
"""


def snoop(user: pwd.struct_passwd, out: Path, page: str) -> dict[str, dict[str, object]]:
    """As ``user``: every file of the run folder, every key of the job's store, and what the page and
    each address the store names answer without the token."""
    done = subprocess.run(
        [PYTHON, "-c", SNOOP, str(user.pw_uid), str(user.pw_gid), str(out), page],
        cwd="/",
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, dict[str, object]] = json.loads(done.stdout)
    return found


def until(check: Callable[[], bool], what: str, seconds: float = 60) -> None:
    """Wait (bounded) until ``check()`` is true."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def owner_opens(url: str) -> str:
    """The page as its owner sees it, once it answers (it starts with rank 0's torch)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=20) as reply:
                return str(reply.read().decode())
        except OSError:
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.1)


def test_another_user_finds_no_debug_token_in_the_store_or_the_run_folder(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    out, marker, port = shared / "OUT", tmp_path / "go", free_port()
    job = write_script(tmp_path, "job.py", JOB)
    argv = ["run", "--cpu", "2", "--grace-period", "1", "--output", str(out)]
    proc = start_cli([*argv, "--debug-server", str(port), str(job), str(marker)], cwd=tmp_path)
    err = ""
    try:
        assert proc.stderr is not None
        while "debug server (torch's" not in err:
            line = proc.stderr.readline()
            assert line, f"the launcher ended before its debug server line: {err}"
            err += line
        found = re.search(rf"http://127\.0\.0\.1:{port}/\?token=([\w-]+)", err)
        assert found, err
        token = found.group(1)
        page = owner_opens(f"http://127.0.0.1:{port}/stacks?token={token}")
        assert "Rank 0" in page and "Rank 1" in page, page[-2000:]  # the owner's own use still works
        log = out / "logs" / "attempt_0" / "rank_0.log"
        until(lambda: "GET /stacks" in log.read_text(), "the page's request log never reached rank 0's log")
        theirs = snoop(auditor, out, f"http://127.0.0.1:{port}")
        keys = owner_opens(f"http://127.0.0.1:{port}/tcpstore?token={token}")
    finally:
        marker.touch()
        stdout, rest = proc.communicate(timeout=60)
    assert proc.returncode == 0, (err + rest)[-3000:]
    seen, answers = theirs["seen"], theirs["answers"]
    assert any(k.startswith("store:debug_server/rank") for k in seen), sorted(seen)  # the store was read
    assert str(log) in seen and "GET /stacks" in str(seen[str(log)]), sorted(seen)  # and the log
    assert [where for where, text in seen.items() if token in str(text)] == [], "the token is readable"
    assert answers[f"http://127.0.0.1:{port}/stacks"] == 403, answers
    assert 200 not in answers.values(), answers
    assert "planted-by-another-user" in keys and "<script>steal()" not in keys, keys  # shown, as text
    ended = [p for p in out.rglob("*") if p.is_file() and token in p.read_text(errors="replace")]
    assert ended == [], ended  # nor in what the run wrote as it ended (run.json, report)
    assert_gone(pids_in(stdout))
