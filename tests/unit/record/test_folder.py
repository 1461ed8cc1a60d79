"""The output folder must be this user's: another user's folder, or one every user can write without the
sticky bit, is refused in one line before anything is written there. Another user is simulated by
changing who this process says it is (``os.geteuid``); tests/integration/security has the real one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from multigpu.contract.errors import UsageError
from multigpu.record import folder
from multigpu.record.folder import check_run_id, claim_output


@pytest.fixture
def someone_else(monkeypatch: pytest.MonkeyPatch) -> int:
    """This process now claims a uid that owns nothing under tmp_path (nor is root)."""
    other = os.geteuid() + 4242
    monkeypatch.setattr(folder.os, "geteuid", lambda: other)
    return other


def refused(path: Path) -> str:
    with pytest.raises(UsageError) as caught:
        claim_output(path, "r1")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"output folder {path}: "), message
    return message


def test_an_existing_folder_of_another_user_is_refused(tmp_path: Path, someone_else: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    message = refused(out)
    assert f"{out} belongs to user " in message and "give the run a folder of your own" in message
    assert list(out.iterdir()) == []  # nothing written: no lock file


def test_a_folder_created_into_another_users_folder_is_refused(tmp_path: Path, someone_else: int) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.getuid() == 0:
        os.chown(theirs, someone_else + 1, -1)  # neither "this" user nor root
    assert f"{theirs} belongs to user " in refused(theirs / "a" / "b")
    assert not (theirs / "a").exists()  # nothing was created in it


def test_root_may_own_the_folder_it_is_created_into(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--output /tmp/x`` as a user: /tmp is root's, sticky; the folders created in it are the user's."""
    if os.geteuid() != 0:
        pytest.skip("the tmp folder must be root's for this case")
    real = os.stat(tmp_path).st_uid
    claim_output(tmp_path / "mine", "r1").release()
    monkeypatch.setattr(folder.os, "geteuid", lambda: real + 4242)
    assert "mine belongs to user" in refused(tmp_path / "mine")  # existing now, and not this user's
    out = tmp_path / "fresh"
    with pytest.raises(UsageError, match=f"{out} belongs to user"):  # created, but as "another" uid
        claim_output(out, "r1")


@pytest.mark.parametrize("where", ["out", "parent"])
def test_writable_by_every_user_without_the_sticky_bit_is_refused(tmp_path: Path, where: str) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    out = parent / "out"
    if where == "out":
        out.mkdir()
    (out if where == "out" else parent).chmod(0o777)
    message = refused(out)
    assert "is writable by every user (and has no sticky bit)" in message and "chmod o-w" in message


def test_sticky_and_group_writable_folders_are_fine(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    claim_output(sticky / "out", "r1").release()
    group = tmp_path / "project"
    group.mkdir()
    group.chmod(0o2775)
    claim_output(group / "runs" / "out", "r1").release()
    claim_output(group / "runs" / "out", "r2").release()  # an existing folder of this user's: reused


def test_a_planted_lock_link_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".multigpu.lock").symlink_to(victim)
    refused(out)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("bad", ["../../x", "a/b", "..", ".", "", "tab\tid", "nl\nid", "x" * 201])
def test_run_id_must_be_a_name(bad: str) -> None:
    with pytest.raises(UsageError, match="--run-id"):
        check_run_id(bad)


def test_an_adopted_run_id_is_checked_too() -> None:
    with pytest.raises(UsageError, match="rendezvous"):
        check_run_id("../elsewhere", "the run id agreed at rendezvous")
    assert check_run_id("20261203-090804-f5d6f1") == "20261203-090804-f5d6f1"


def test_a_locked_output_folder_refuses_a_second_run(tmp_path: Path) -> None:
    first = claim_output(tmp_path / "out", "run-one")
    try:
        with pytest.raises(UsageError, match=r"in use by run run-one \(launcher pid \d+\)"):
            claim_output(tmp_path / "out", "run-two")
        other_node = claim_output(tmp_path / "out", "run-one", node=1)  # nodes of one run share it
        other_node.release()
    finally:
        first.release()
    claim_output(tmp_path / "out", "run-two").release()  # free again once the first has ended
    assert not list((tmp_path / "out").glob(".multigpu*.lock"))  # issue 22: no lock left after a run


def test_a_run_that_locked_a_removed_lock_file_locks_anew(tmp_path: Path) -> None:
    """The ending run removes its lock file while a new run may already have it open: the new run must
    not keep a lock on the removed file (a third run would then lock a fresh one beside it)."""
    import fcntl

    folder = tmp_path / "out"
    first = claim_output(folder, "run-one")
    fd = os.open(folder / ".multigpu.lock", os.O_RDWR)
    try:
        first.release()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this fd holds the removed file's lock
        second = claim_output(folder, "run-two")
        with pytest.raises(UsageError, match="in use by run run-two"):
            claim_output(folder, "run-three")
        second.release()
    finally:
        os.close(fd)


def test_a_file_or_device_as_the_output_gets_no_chmod_advice(tmp_path: Path) -> None:
    """``--output /dev/null`` (writable by every user, a device): it is not a folder, and says so."""
    loose = tmp_path / "loose.txt"
    loose.write_text("")
    loose.chmod(0o666)
    for path in (Path("/dev/null"), loose, loose / "sub"):
        message = refused(path)
        assert message == f"output folder {path}: it (or a folder above it) is a file, not a folder", message
    assert loose.read_text() == ""


OTHER = 54321
"""A uid nobody has: another user's link or folder, made by root with ``lchown``."""
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")


@needs_root
def test_another_users_link_as_the_output_folder_is_refused(tmp_path: Path) -> None:
    """``/shared/run -> /victim`` planted by someone else: refused as resolved, the victim unchanged."""
    victim = tmp_path / "victim"
    victim.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    link = shared / "run"
    link.symlink_to(victim)
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(UsageError) as caught:
        folder.resolve_output(link)
    assert str(caught.value) == (
        f"output folder {link}: {link} is a link made by user uid {OTHER}, who could redirect what "
        f"this run writes; give the run a folder of your own"
    )
    assert "is a link made by user" in refused(link)  # claim_output walks it the same way
    assert list(victim.iterdir()) == []
    own = shared / "own"
    own.symlink_to(victim)  # the user's own link: followed, as Path.resolve() does
    assert folder.resolve_output(own) == victim


@needs_root
def test_a_logs_link_planted_in_a_sticky_output_folder_refuses_the_claim(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o1777)  # root's own, open to all with the sticky bit: accepted as such
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (out / "logs").symlink_to(theirs)
    os.lchown(out / "logs", OTHER, OTHER)
    message = refused(out)
    assert message.endswith(
        f"{out / 'logs'} is a link made by user uid {OTHER}, who could redirect what "
        "this run writes; give the run a folder of your own"
    ), message
    assert list(theirs.iterdir()) == []
    (out / "logs").unlink()
    claim_output(out, "r1").release()
    assert (out / "logs").is_dir() and not (out / "logs").is_symlink()
