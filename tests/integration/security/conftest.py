"""The second real local user for the security tier (issues 36 and 43).

One user, ``multigpu-auditor``, for the whole test session: created at the first test that needs it and
removed at the end. Every module of this tier marks its tests ``xdist_group("second_user")``, so that
they all run in one worker and /etc/passwd is never edited by two workers at once (machines are reused:
a leftover from an earlier run is removed first). Needs root; under ``CI=true`` without root the tier
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

AUDITOR = "multigpu-auditor"


def _remove_user() -> None:
    with_user = subprocess.run(["getent", "passwd", AUDITOR], capture_output=True)
    if with_user.returncode == 0:
        subprocess.run(["userdel", AUDITOR], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def auditor() -> Iterator[pwd.struct_passwd]:
    """The second user (no home, no login shell), created once for the session and removed after."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        tier_cannot_run("the second-user tests need root and useradd to create a local user")
    _remove_user()
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", AUDITOR],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        yield pwd.getpwnam(AUDITOR)
    finally:
        _remove_user()


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
