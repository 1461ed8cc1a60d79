"""Function mode's payload is code every rank runs: a rank loads it only while it is still the file the
caller wrote (a 0600 file of this user's, not a link); a swapped one is refused, naming what is wrong."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from multigpu.contract.files import create_new
from multigpu.rank import bootstrap
from multigpu.rank.bootstrap import open_payload


def payload(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "payload.pkl"
    with os.fdopen(create_new(path, mode), "wb") as f:
        f.write(pickle.dumps("the caller's"))
    os.chmod(path, mode)
    return path


def test_the_callers_payload_is_loaded(tmp_path: Path) -> None:
    with open_payload(str(payload(tmp_path))) as f:
        assert pickle.load(f) == "the caller's"


def test_a_payload_others_can_write_or_read_is_refused(tmp_path: Path) -> None:
    path = payload(tmp_path, 0o644)
    with pytest.raises(PermissionError, match=r"refusing the function-mode payload .*: it has mode 0644"):
        open_payload(str(path))


def test_a_swapped_in_link_is_refused(tmp_path: Path) -> None:
    real = payload(tmp_path)
    link = tmp_path / "swapped.pkl"
    link.symlink_to(real)
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        open_payload(str(link))


def test_a_payload_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = payload(tmp_path)
    monkeypatch.setattr(bootstrap.os, "geteuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(PermissionError, match="it belongs to uid"):
        open_payload(str(path))


def test_a_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "payload.pkl"
    folder.mkdir(mode=0o700)
    with pytest.raises(OSError):
        open_payload(str(folder))
