"""The second real local user for the security tier (issues 36 and 43).

One user, ``mgpu-aud<PID>`` (the test process's PID), for the whole test session: created at the first
test that needs it and removed at the end. Every module of this tier marks its tests
``xdist_group("second_user")``, so that they all run in one worker. The name is the session's own, so
that two test sessions on one machine (two checkouts tested at once) never remove each other's user;
machines are reused, so a leftover of a session that was killed (its PID no longer alive) is removed
first. Needs root; under ``CI=true`` without root the tier
fails, saying so.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import tier_cannot_run

PREFIX = "mgpu-aud"
AUDITOR = f"{PREFIX}{os.getpid()}"


def _remove_user(name: str) -> None:
    with_user = subprocess.run(["getent", "passwd", name], capture_output=True)
    if with_user.returncode == 0:
        subprocess.run(["userdel", name], check=True, capture_output=True, timeout=30)


def _remove_leftovers() -> None:
    """Users of earlier sessions that were killed before their teardown: their PID is gone."""
    for entry in pwd.getpwall():
        pid = entry.pw_name.removeprefix(PREFIX)
        if entry.pw_name.startswith(PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove_user(entry.pw_name)


@pytest.fixture(scope="session")
def auditor() -> Iterator[pwd.struct_passwd]:
    """The second user (no home, no login shell), created once for the session and removed after."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        tier_cannot_run("the second-user tests need root and useradd to create a local user")
    _remove_leftovers()
    _remove_user(AUDITOR)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", AUDITOR],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        yield pwd.getpwnam(AUDITOR)
    finally:
        _remove_user(AUDITOR)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder both users can reach and create in, like /tmp (sticky, open to all); tmp_path is not
    reachable by the second user (pytest makes it 0700)."""
    path = Path(tempfile.mkdtemp(prefix="multigpu-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text("root's own\n")
    return path
