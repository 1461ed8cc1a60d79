"""Nothing another local user planted redirects a run: a link as the output folder or as its ``logs``,
a FIFO at a rank log's path, a link at OTX's hyper-parameter file, a link at a guessable ``--log-dir``
name (issue 43). Tried with the real second user of conftest.py, for root and for an ordinary user;
each planted link's target is unchanged afterwards."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import PYTHON, clean_env, run_cli, write_script

from .conftest import AUDITOR
from .test_second_user import as_user

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.xdist_group("second_user")]

HELLO = """
    import os
    print(f"pid={os.getpid()} hello from rank", flush=True)
"""

NOBODY = 54321
"""A third party, for the ordinary user's case: a uid nobody has, given a link by root (``lchown``)."""


def contents(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (names relative to it) and what it holds: the target of a planted
    link, compared before and after."""
    return {
        str(p.relative_to(folder)): "<dir>" if p.is_dir() else p.read_text()
        for p in sorted(folder.rglob("*"))
    }


def refusal(link: Path, owner: str) -> str:
    return (
        f"output folder {link}: {link} is a link made by user {owner}, who could redirect what this "
        f"run writes; give the run a folder of your own"
    )


def test_root_never_writes_through_a_link_planted_as_the_output_folder(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    """``/shared/run -> /victim``: refused in one line; nothing written in root's folder there."""
    target = tmp_path / "victim_run"
    target.mkdir()
    (target / "notes.txt").write_text("root's own\n")
    link = shared / "run"
    as_user(auditor, "ln", "-s", str(target), str(link))
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(link), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.splitlines()[0] == f"multigpu run: error: {refusal(link, AUDITOR)}", result.stderr
    assert "Traceback" not in result.stderr
    assert "hello from rank" not in result.stdout
    assert contents(target) == {"notes.txt": "root's own\n"}


AS_USER_CLAIM = """
import os, sys
from pathlib import Path
import multigpu.function.launch_config
from multigpu.contract.errors import UsageError
from multigpu.record.folder import claim_output, resolve_output
os.setgroups([])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[1]))  # from here on this process is the second user, to the kernel too
for way in ("run", "launch"):
    try:
        if way == "run":  # what multigpu run does with --output (runner/attempts.py)
            claim_output(resolve_output(Path(sys.argv[3])), "r1").release()
        else:  # multigpu.launch(output=...)
            multigpu.function.launch_config._output(sys.argv[3], "output")
    except UsageError as exc:
        print(f"{way}: {exc}", flush=True)
"""


def test_an_ordinary_user_never_writes_through_a_link_planted_as_the_output_folder(
    auditor: pwd.struct_passwd, shared: Path
) -> None:
    """The same as an ordinary user (the auditor), the link planted by a third user: the output folder
    code of ``multigpu run`` and ``launch(output=...)``, run as the auditor, refuses it before anything
    is written into the auditor's own folder it points to."""
    target = shared / "auditors_run"
    as_user(auditor, "mkdir", str(target))
    as_user(auditor, "sh", "-c", f"echo mine > {target}/notes.txt")
    link = shared / "run"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    result = subprocess.run(
        [PYTHON, "-c", AS_USER_CLAIM, str(auditor.pw_uid), str(auditor.pw_gid), str(link)],
        cwd="/",
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.splitlines() == [
        f"run: {refusal(link, f'uid {NOBODY}')}",
        f"launch: {refusal(link, f'uid {NOBODY}')}",
    ], result.stdout
    assert contents(target) == {"notes.txt": "mine\n"}


def test_a_logs_link_planted_in_a_sticky_output_folder_is_refused(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    """Root's own output folder, sticky and open to all: the auditor's ``logs`` link there refuses the
    run in one line; no rank log lands in the auditor's folder."""
    out = shared / "OUT"
    out.mkdir()
    out.chmod(0o1777)
    theirs = shared / "theirs"
    as_user(auditor, "mkdir", str(theirs))
    as_user(auditor, "ln", "-s", str(theirs), str(out / "logs"))
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    logs = out / "logs"
    assert result.stderr.splitlines()[0] == (
        f"multigpu run: error: output folder {out}: {logs} is a link made by user {AUDITOR}, who could "
        f"redirect what this run writes; give the run a folder of your own"
    ), result.stderr
    assert contents(theirs) == {}
    assert "hello from rank" not in result.stdout


def test_a_fifo_planted_at_a_rank_log_ends_the_launcher_in_one_line(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    """``mkfifo <out>/logs/attempt_0/rank_0.log`` by the auditor in a sticky output folder: the launcher
    says so in one line within 5 s, never waits in ``open()``; the FIFO is left as it was."""
    out = shared / "OUT"
    out.mkdir()
    out.chmod(0o1777)
    fifo = out / "logs" / "attempt_0" / "rank_0.log"
    as_user(auditor, "mkdir", "-p", str(fifo.parent))
    as_user(auditor, "mkfifo", str(fifo))
    script = write_script(tmp_path, "hello.py", HELLO)
    started = time.monotonic()
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert time.monotonic() - started < 5, result.stderr
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.splitlines()[0] == (
        f"multigpu run: error: output folder {out}: {out / 'logs'} belongs to user {AUDITOR}, who could "
        f"redirect what this run writes; give the run a folder of your own"
    ), result.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_fifo_at_a_rank_log_in_the_users_own_folder_is_refused_without_waiting(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    """Past the folder checks (the folders on the way root's own, open to all with the sticky bit), the
    auditor's FIFO at the log's name: one line, and the run goes on without that log, never blocked."""
    out = shared / "OUT"
    attempt = out / "logs" / "attempt_0"
    attempt.mkdir(parents=True)
    for folder in (out, out / "logs", attempt):
        folder.chmod(0o1777)
    fifo = attempt / "rank_0.log"
    as_user(auditor, "mkfifo", str(fifo))
    script = write_script(tmp_path, "hello.py", HELLO)
    started = time.monotonic()
    result = run_cli(["run", "--cpu", "1", "--output", str(out), str(script)], cwd=tmp_path, timeout=60)
    assert time.monotonic() - started < 5, result.stderr
    assert result.returncode == 0, (result.stdout, result.stderr)
    refused = [line for line in result.stderr.splitlines() if line.startswith("multigpu: cannot write")]
    assert refused == [
        f"multigpu: cannot write {fifo}: {fifo} is a FIFO, not a regular file; the rest of its output is "
        f"lost (the run goes on)"
    ], result.stderr
    assert "hello from rank" in result.stdout and stat.S_ISFIFO(os.lstat(fifo).st_mode)


MANAGER = """
import sys
from multigpu.otx.manager import MultiGPUManager
from multigpu.contract.errors import MultiGPUError

def train():
    pass

if __name__ == "__main__":
    manager = MultiGPUManager(train, "0,1", device="cpu")
    try:
        manager.setup_multi_gpu_train(sys.argv[1], {"learning_rate": 0.01})
    except MultiGPUError as exc:
        print(f"REFUSED {exc}", flush=True)
        sys.exit(2)
    manager.finalize()
"""


@pytest.mark.parametrize("planted", ["optimized_hyper_parameters.json", "logs"])
def test_otx_manager_refuses_a_folder_another_user_prepared(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path, planted: str
) -> None:
    """``setup_multi_gpu_train`` as root into the auditor's folder, a link planted in it: refused as
    ``multigpu run`` refuses it, nothing written through the link."""
    out = shared / "OTX"
    as_user(auditor, "mkdir", str(out))
    target = tmp_path / "victim"
    target.mkdir()
    (target / "optimized_hyper_parameters.json").write_text("root's own\n")
    aim = target / "optimized_hyper_parameters.json" if planted != "logs" else target
    as_user(auditor, "ln", "-s", str(aim), str(out / planted))
    script = write_script(tmp_path, "manager.py", MANAGER)
    result = subprocess.run(
        [PYTHON, str(script), str(out)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == (
        f"REFUSED output folder {out}: {out} belongs to user {AUDITOR}, who could redirect what this run "
        f"writes; give the run a folder of your own\n"
    ), result.stderr
    assert contents(target) == {"optimized_hyper_parameters.json": "root's own\n"}


def test_otx_hyper_parameters_replace_a_link_planted_in_a_sticky_folder(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    """Root's own sticky folder, the auditor's link at ``optimized_hyper_parameters.json``: the file is
    written in the link's place, the link's target untouched (prepare and write_inputs, as the manager
    calls them, in this process)."""
    from multigpu.otx import prepare as fm

    out = shared / "OTX"
    out.mkdir()
    out.chmod(0o1777)
    target = tmp_path / "victim.json"
    target.write_text("root's own\n")
    hpo = out / fm.HPO_FILE
    as_user(auditor, "ln", "-s", str(target), str(hpo))
    argv = list(sys.argv)
    prepared = fm.prepare(str(out), {"learning_rate": 0.01}, print)
    try:
        fm.write_inputs(prepared, print, ())
    finally:
        sys.argv[:] = argv
        prepared.remove_payload()
    assert target.read_text() == "root's own\n"
    assert not hpo.is_symlink() and '"learning_rate": 0.01' in hpo.read_text()


def test_log_dir_names_cannot_be_guessed_and_planted(
    auditor: pwd.struct_passwd, shared: Path, tmp_path: Path
) -> None:
    """``--log-dir`` in a shared folder: the auditor plants links at ``<run id>_<pid>`` for the next pids;
    the run's folder has mkdtemp's suffix, so no stdout.log, stderr.log or error.json reaches them."""
    theirs = shared / "theirs"
    as_user(auditor, "mkdir", str(theirs))
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    for pid in range(last + 1, last + 400):  # made here (no process uses up the pids), given to the auditor
        planted = shared / f"guess_{pid}"
        planted.symlink_to(theirs)
        os.lchown(planted, auditor.pw_uid, auditor.pw_gid)
    script = write_script(tmp_path, "hello.py", HELLO)
    result = run_cli(
        [
            "run",
            "--cpu",
            "1",
            "--run-id",
            "guess",
            "--log-dir",
            str(shared),
            "-r",
            "3",
            "--output",
            str(tmp_path / "out"),
            str(script),
        ],
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert contents(theirs) == {}
    (made,) = [p for p in shared.glob("guess_*") if not p.is_symlink()]
    assert made.stat().st_uid == 0 and stat.S_IMODE(made.stat().st_mode) == 0o700
    assert "hello from rank" in (made / "attempt_0" / "0" / "stdout.log").read_text()
