"""Function launches' records under the user's cache folder: a bounded history that never removes a
live run's folder, nor anything that is not this user's own real folder. In-process, no launch (the
launches themselves: ``integration/function/test_launch.py``)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from multigpu.function.run_history import default_output, prune, runs_root


def _runs(root: Path, count: int) -> list[Path]:
    """``count`` finished run folders, oldest first (by their last change)."""
    folders = []
    for i in range(count):
        folder = root / f"run-{i}"
        folder.mkdir(parents=True)
        (folder / "run.json").write_text("{}")
        os.utime(folder, (1_000_000 + i, 1_000_000 + i))
        folders.append(folder)
    return folders


def test_the_root_is_xdg_cache_home_else_home_dot_cache(tmp_path: Path) -> None:
    assert runs_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "multigpu" / "runs"
    assert runs_root({"XDG_CACHE_HOME": "", "HOME": "/h"}) == Path("/h/.cache/multigpu/runs")
    assert runs_root({"XDG_CACHE_HOME": "cache", "HOME": "/h"}) == Path("/h/.cache/multigpu/runs")


def test_the_history_keeps_the_newest_and_removes_the_oldest_whole(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    folders = _runs(root, 6)
    assert prune(root, 4) == ["run-1", "run-0"]
    assert sorted(p.name for p in root.iterdir()) == [f.name for f in folders[2:]]
    assert prune(root, 4) == []


def test_a_live_runs_folder_is_never_removed(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    oldest, *_ = _runs(root, 3)
    fd = os.open(oldest / ".multigpu.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the launcher's claim_output holds it
        os.utime(oldest, (999_999, 999_999))  # still the oldest, its lock file made
        assert prune(root, 1) == ["run-1"]
        assert oldest.is_dir() and (oldest / "run.json").exists()
    finally:
        os.close(fd)
    assert prune(root, 1) == ["run-0"]  # its launcher gone (a crash left the lock file): removed


def test_links_and_files_in_the_history_are_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    _runs(root, 2)
    (root / "a-link").symlink_to(victim)
    os.utime(root / "a-link", (1, 1), follow_symlinks=False)
    (root / "a-file").write_text("x")
    assert prune(root, 0) == ["run-1", "run-0"]
    assert (victim / "keep.txt").read_text() == "mine" and (root / "a-link").is_symlink()
    assert (root / "a-file").exists()


def test_each_launch_makes_room_for_itself_in_a_private_folder(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    root = runs_root(env)
    assert default_output("first", env) == root / "first" and list(root.iterdir()) == []
    _runs(root, 5)
    out = default_output("new", env, keep=3)
    assert out == root / "new" and not out.exists()  # the launcher creates and claims it
    assert sorted(p.name for p in root.iterdir()) == ["run-3", "run-4"]  # with the new one: 3
    for folder in (root, root.parent):
        assert folder.stat().st_mode & 0o777 == 0o700
