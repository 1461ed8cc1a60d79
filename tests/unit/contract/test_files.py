"""The launcher's own file opens in the run folder: a planted link is replaced, never written through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from multigpu.contract.files import create_new, current_umask, open_existing, temporary_beside


def test_the_umask_is_read_without_changing_it() -> None:
    before = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        assert current_umask() == 0o027
    finally:
        os.umask(before)


def test_a_planted_link_is_replaced_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "rank_0.log"
    log.symlink_to(victim)
    with os.fdopen(create_new(log), "wb") as f:
        f.write(b"hello from rank\n")
    assert victim.read_text() == "precious\n"
    assert not log.is_symlink() and log.read_text() == "hello from rank\n"


def test_a_hard_link_is_replaced_too(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "rank_0.log"
    os.link(victim, log)
    os.close(create_new(log))
    assert victim.read_text() == "precious\n" and log.read_bytes() == b""
    assert os.stat(log).st_ino != os.stat(victim).st_ino


def test_new_files_follow_the_umask_or_the_mode_given(tmp_path: Path) -> None:
    before = os.umask(0o027)
    try:
        os.close(create_new(tmp_path / "log"))
        os.close(create_new(tmp_path / "payload", 0o600))
        fd, tmp = temporary_beside(tmp_path / "run.json")
        os.close(fd)
    finally:
        os.umask(before)
    assert stat.S_IMODE(os.stat(tmp_path / "log").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(tmp_path / "payload").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o640
    assert tmp.parent == tmp_path and tmp.name.startswith(".run.json.") and tmp.name.endswith(".tmp")
    assert str(os.getpid()) not in tmp.name.removeprefix(".run.json.").removesuffix(".tmp")


def test_an_existing_file_is_not_opened_through_a_link(tmp_path: Path) -> None:
    (tmp_path / "victim").write_text("precious\n")
    (tmp_path / "record.json").symlink_to(tmp_path / "victim")
    with pytest.raises(OSError):
        open_existing(tmp_path / "record.json", os.O_RDWR)
    (tmp_path / "real.json").write_text("{}\n")
    os.close(open_existing(tmp_path / "real.json", os.O_RDWR))


def test_an_older_file_is_emptied_and_a_device_opened_as_it_is(tmp_path: Path) -> None:
    old = tmp_path / "rank_0.log"
    old.write_text("the run before's\n")
    inode = os.stat(old).st_ino
    os.close(create_new(old))
    assert old.read_bytes() == b"" and os.stat(old).st_ino == inode
    os.close(create_new(Path("/dev/null")))  # a log path of the user's choosing: left a device
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
