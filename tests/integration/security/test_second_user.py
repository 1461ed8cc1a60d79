"""A run is its user's alone, tried as a real second local user would (issue 36).

One user, ``multigpu-auditor``, for the whole test session: created at the first test that needs it and
removed at the end, all in one xdist group so that /etc/passwd is never edited by two workers at once
(machines are reused: a leftover from an earlier run is removed first). Needs root; under ``CI=true``
without root the tier fails, saying so.
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

from helpers import assert_gone, pids_in, run_cli, tier_cannot_run, write_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.xdist_group("second_user")]

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
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", AUDITOR],
                   check=True, capture_output=True, timeout=30)
    try:
        yield pwd.getpwnam(AUDITOR)
    finally:
        _remove_user()


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Path]:
    """A folder both users can reach and create in, like /tmp (sticky, open to all); tmp_path is not
    reachable by the second user (pytest makes it 0700)."""
    path = Path(tempfile.mkdtemp(prefix="multigpu-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_user(user: pwd.struct_passwd, *argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=30, user=user.pw_uid,
                   group=user.pw_gid, extra_groups=[])


def plant(user: pwd.struct_passwd, out: Path, victim: Path) -> Path:
    """As ``user``: rank 0's log of the next run into ``out`` made a link to ``victim``."""
    log = out / "logs" / "attempt_0" / "rank_0.log"
    as_user(user, "mkdir", "-p", str(log.parent))
    as_user(user, "ln", "-s", str(victim), str(log))
    assert log.is_symlink()
    return log


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text("root's own\n")
    return path


HELLO = """
    import os
    print(f"pid={os.getpid()} hello from rank", flush=True)
"""


def test_a_planted_link_in_another_users_folder_writes_nothing(auditor: pwd.struct_passwd, shared: Path,
                                                              victim: Path, tmp_path: Path) -> None:
    """The issue's audit: the auditor makes OUT and plants rank 0's log as a link to a root-owned file."""
    out = shared / "OUT"
    plant(auditor, out, victim)
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.splitlines()[0] == (f"multigpu run: error: output folder {out}: {out} belongs to "
                                             f"user {AUDITOR}, who could redirect what this run writes; give "
                                             f"the run a folder of your own"), result.stderr
    assert "Traceback" not in result.stderr
    assert "hello from rank" not in result.stdout
    assert victim.read_text() == "root's own\n"


def test_a_link_planted_in_a_folder_open_to_all_writes_nothing(auditor: pwd.struct_passwd, shared: Path,
                                                              victim: Path, tmp_path: Path) -> None:
    """Root's own OUT, left writable by every user (no sticky bit): refused before anything is written."""
    out = shared / "OUT"
    out.mkdir()
    out.chmod(0o777)
    plant(auditor, out, victim)
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"multigpu run: error: output folder {out}: {out} is writable by every user "
                            f"(and has no sticky bit)"), result.stderr
    assert "Traceback" not in result.stderr
    assert victim.read_text() == "root's own\n"


def test_a_link_left_in_the_users_own_folder_is_replaced(shared: Path, victim: Path, tmp_path: Path) -> None:
    """The second wall: in a folder of the run's own user, a link already where a log goes (left by
    anything) is replaced by the log, not written through."""
    out = tmp_path / "OUT"
    log = out / "logs" / "attempt_0" / "rank_0.log"
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "root's own\n"
    assert not log.is_symlink() and "hello from rank" in log.read_text()
    assert_gone(pids_in(result.stdout))
