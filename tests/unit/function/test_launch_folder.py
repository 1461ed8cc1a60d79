"""The sweep of dead callers' launch folders: only a folder whose caller lock is free goes; a live
caller's, a folder still being made, a link and anything else are left. In-process (a caller killed
for real: ``integration/function/test_launch_folder.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from multigpu.function.launch_folder import CALLER_LOCK, PREFIX, PrivateFolder, sweep


def _dead_callers_folder(temp: Path, name: str) -> Path:
    """What a caller killed mid-launch leaves: its folder, its request, its lock (now free)."""
    folder = temp / f"{PREFIX}{name}"
    folder.mkdir(mode=0o700)
    (folder / "request.pkl").write_bytes(b"the caller's environment")
    (folder / CALLER_LOCK).write_text("caller pid 1\n")
    return folder


def test_a_dead_callers_folder_is_swept_a_live_ones_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = _dead_callers_folder(tmp_path, "dead")
    making = tmp_path / f"{PREFIX}making"  # mkdtemp done, the lock not yet there: not a dead caller's
    making.mkdir()
    taking = tmp_path / f"{PREFIX}taking"  # its lock created, not yet taken (and so not yet written)
    taking.mkdir()
    (taking / CALLER_LOCK).write_text("")
    other = tmp_path / "multigpu-other"
    other.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = PrivateFolder()  # sweeps first: the dead caller's folder goes
    assert not dead.exists()
    assert sweep(tmp_path) == []  # this live caller's lock is held
    assert live.path.is_dir() and making.is_dir() and taking.is_dir() and other.is_dir()
    assert live.path.stat().st_mode & 0o777 == 0o700
    live.remove()
    assert not live.path.exists()
    live.remove()  # twice: nothing more


def test_a_link_or_a_file_named_like_a_launch_folder_is_left_alone(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = _dead_callers_folder(elsewhere, "v")
    temp = tmp_path / "temp"
    temp.mkdir()
    (temp / f"{PREFIX}link").symlink_to(victim)
    (temp / f"{PREFIX}file").write_text("x")
    assert sweep(temp) == []
    assert (victim / "request.pkl").exists() and (temp / f"{PREFIX}link").is_symlink()
    assert (temp / f"{PREFIX}file").exists()
    assert sweep(elsewhere) == [victim]
    assert not os.path.lexists(victim)
