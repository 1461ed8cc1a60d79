"""The launcher's own file opens in the run folder: a planted link is replaced, never written through;
folders reached one name at a time (``open_folder``, ``resolve_trusted``); a log's name refused when it
holds anything but this user's regular file (``create_file``). Another user's link or entry is made by
root with ``lchown`` to a uid nobody has (the second-user tests in tests/integration/security/ do the
same with a real user and a real launcher)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from multigpu.contract.files import (
    Planted,
    create_file,
    create_new,
    current_umask,
    open_existing,
    open_folder,
    resolve_trusted,
    temporary_beside,
    write_private,
)


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


OTHER = 54321
"""A uid nobody on the machine has: a "user uid 54321", as the refusals name it."""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another uid needs root")


def planted_link(at: Path, target: Path) -> Path:
    at.symlink_to(target)
    os.lchown(at, OTHER, OTHER)
    return at


def sticky(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o1777)
    return path


def test_own_links_are_followed_as_resolve_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "abs").symlink_to(tmp_path / "real")
    (tmp_path / "rel").symlink_to("real/sub")
    monkeypatch.chdir(tmp_path)
    for given in ("abs/sub", "rel", "rel/../sub", "abs/missing/../x", str(tmp_path / "rel" / "new")):
        assert resolve_trusted(Path(given)) == Path(given).resolve(), given
    fd = open_folder(Path("abs/made/deeper"), create=True)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / "real" / "made" / "deeper"))
    finally:
        os.close(fd)


def test_a_file_on_the_way_is_not_a_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        resolve_trusted(tmp_path / "file" / "x")
    with pytest.raises(NotADirectoryError):
        resolve_trusted(Path("/dev/null"))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(OSError, match="Too many levels"):
        resolve_trusted(tmp_path / "loop" / "x")


@needs_root
def test_another_users_link_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "record.json").write_text("precious\n")
    shared = sticky(tmp_path / "shared")
    link = planted_link(shared / "run", victim)
    with pytest.raises(Planted, match=rf"^\[Errno 1\] {link} is a link made by user uid {OTHER}, who could"):
        resolve_trusted(link)
    with pytest.raises(Planted):
        os.close(open_folder(link / "logs", create=True))
    with pytest.raises(Planted):
        os.close(create_file(link / "record.json"))
    assert sorted(os.listdir(victim)) == ["record.json"]
    assert (victim / "record.json").read_text() == "precious\n"


@needs_root
def test_in_a_sticky_folder_only_the_users_own_entries_are_entered(tmp_path: Path) -> None:
    shared = sticky(tmp_path / "shared")
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(Planted, match=f"{theirs} belongs to user uid {OTHER}"):
        os.close(open_folder(theirs / "logs", create=True))
    assert list(theirs.iterdir()) == []
    mine = shared / "mine"
    mine.mkdir()
    os.close(open_folder(mine / "logs", create=True))  # the user's own (root's here): fine
    plain = tmp_path / "plain"
    plain.mkdir()
    os.chown(plain, OTHER, OTHER)  # not a sticky folder: the folder checks (record/folder.py) judge it
    os.close(open_folder(plain))


def test_a_fifo_at_a_logs_name_is_refused_at_once(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "attempt_0" / "rank_0.log"
    log.parent.mkdir(parents=True)
    os.mkfifo(log)
    started = time.monotonic()
    with pytest.raises(Planted, match=f"^\\[Errno 1\\] {log} is a FIFO, not a regular file$"):
        create_file(log)
    assert time.monotonic() - started < 1
    assert stat.S_ISFIFO(os.lstat(log).st_mode)


@needs_root
def test_another_users_file_is_neither_emptied_nor_written(tmp_path: Path) -> None:
    log = tmp_path / "rank_0.log"
    log.write_text("theirs\n")
    os.chown(log, OTHER, OTHER)
    with pytest.raises(Planted, match=f"{log} belongs to user uid {OTHER}"):
        create_file(log)
    assert log.read_text() == "theirs\n"


def test_own_files_are_emptied_links_replaced_and_folders_made(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "out" / "logs" / "attempt_0" / "rank_0.log"
    with os.fdopen(create_file(log), "wb") as f:
        f.write(b"first\n")
    with os.fdopen(create_file(log), "wb") as f:  # the run before's log, emptied
        f.write(b"second\n")
    assert log.read_text() == "second\n"
    log.unlink()
    log.symlink_to(victim)
    os.close(create_file(log))
    assert victim.read_text() == "precious\n" and not log.is_symlink()


def test_a_private_file_gets_a_private_folder_only_at_the_end(tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        write_private(tmp_path / "out" / ".multigpu" / "payload.pkl", b"x")
    finally:
        os.umask(before)
    assert stat.S_IMODE(os.stat(tmp_path / "out" / ".multigpu").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o755
