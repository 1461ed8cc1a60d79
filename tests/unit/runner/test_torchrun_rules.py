"""What torchrun's options change in each worker's spec: files, console streams, environment, argv."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from multigpu.cli.run_args import parse_run_args
from multigpu.contract.errors import UsageError
from multigpu.contract.names import AFFINITY_ENV
from multigpu.runner.specs import AttemptContext, build_specs, worker_argv
from multigpu.supervisor.states import WorkerSpec

pytestmark = pytest.mark.usefixtures("no_gpu")


def specs(argv: list[str], tmp_path: Path, cvd: str | None = None, attempt: int = 1) -> list[WorkerSpec]:
    script = tmp_path / "train.py"
    script.write_text("")
    config, _ = parse_run_args([*argv, str(script)], {})
    context = AttemptContext("job1", tmp_path / "out", attempt, "127.0.0.1", 1234, cvd, launcher_pid=4321)
    return build_specs(config, context, {"PATH": "/bin"})


def run_dir(log_dir: Path) -> Path:
    """torchrun's ``<log_dir>/<run id>_<random>``: the one folder there, named as mkdtemp names."""
    (found,) = log_dir.glob("job1_*")
    assert len(found.name) == len("job1_") + 8 and found.name != "job1_4321", found.name
    return found


def test_log_dir_files_where_torchrun_writes_them(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    workers = specs(["--nproc-per-node", "2", "--log-dir", str(logs), "-r", "3", "-t", "0:1"], tmp_path)
    attempt = run_dir(logs) / "attempt_1"
    for w in workers:
        rank_dir = attempt / str(w.local_rank)
        assert rank_dir.is_dir()
        assert dict(w.stream_files) == {"stdout": rank_dir / "stdout.log", "stderr": rank_dir / "stderr.log"}
        assert w.error_file == rank_dir / "error.json"
        assert w.env["TORCHELASTIC_ERROR_FILE"] == str(rank_dir / "error.json")
        assert w.log_path == tmp_path / "out" / "logs" / "attempt_1" / f"rank_{w.rank}.log"  # ours stay
    assert workers[0].console_streams == {"stdout"}  # teed stdout shows, redirected stderr does not
    assert workers[1].console_streams == frozenset()


def test_without_log_options_nothing_changes(tmp_path: Path) -> None:
    worker = specs(["--nproc-per-node", "1"], tmp_path)[0]
    assert dict(worker.stream_files) == {} and worker.console_streams == {"stdout", "stderr"}
    assert worker.error_file == tmp_path / "out" / "logs" / "attempt_1" / "error_rank_0.json"
    assert AFFINITY_ENV not in worker.env


def test_log_dir_dev_null_is_torchruns_no_files(tmp_path: Path) -> None:
    """torchrun's DefaultLogsSpecs: ``--log-dir /dev/null`` makes no folder and redirects nothing."""
    workers = specs(["--nproc-per-node", "2", "--log-dir", os.devnull, "-r", "3", "-t", "3"], tmp_path)
    for worker in workers:
        assert dict(worker.stream_files) == {} and worker.console_streams == {"stdout", "stderr"}
        assert worker.error_file == tmp_path / "out" / "logs" / "attempt_1" / f"error_rank_{worker.rank}.json"


def test_log_dir_alone_makes_the_rank_dirs_and_error_files(tmp_path: Path) -> None:
    worker = specs(["--log-dir", str(tmp_path / "l")], tmp_path)[0]
    assert worker.error_file == run_dir(tmp_path / "l") / "attempt_1" / "0" / "error.json"
    assert dict(worker.stream_files) == {} and worker.console_streams == {"stdout", "stderr"}


def test_log_dir_names_are_not_predictable_and_kept_across_attempts(tmp_path: Path) -> None:
    """torchrun's suffix is mkdtemp's, not the launcher's pid (another user could plant a link at a
    name they can guess); every attempt of one launcher finds the same folder, private to its user."""
    first = specs(["--log-dir", str(tmp_path / "a")], tmp_path)[0]
    again = specs(["--log-dir", str(tmp_path / "a")], tmp_path, attempt=2)[0]
    other = specs(["--log-dir", str(tmp_path / "b")], tmp_path)[0]
    folder = run_dir(tmp_path / "a")
    assert first.error_file is not None and again.error_file is not None and other.error_file is not None
    assert first.error_file.parents[2] == again.error_file.parents[2] == folder
    assert again.error_file == folder / "attempt_2" / "0" / "error.json"
    assert run_dir(tmp_path / "b").name != folder.name
    assert oct(folder.stat().st_mode & 0o777) == "0o700"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a link to another uid needs root")
def test_a_log_dir_through_another_users_link_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "logs").symlink_to(theirs)
    os.lchown(shared / "logs", 54321, 54321)
    with pytest.raises(
        UsageError, match=rf"^--log-dir {shared / 'logs'}: {shared / 'logs'} is a link made by"
    ):
        specs(["--log-dir", str(shared / "logs")], tmp_path)
    assert list(theirs.iterdir()) == []


def test_tee_without_log_dir_writes_under_the_run_directory(tmp_path: Path) -> None:
    worker = specs(["--tee", "3"], tmp_path)[0]
    assert (
        worker.stream_files["stdout"]
        == run_dir(tmp_path / "out" / "torchrun_logs") / "attempt_1" / "0" / "stdout.log"
    )


def test_role_and_virtual_local_rank(tmp_path: Path) -> None:
    workers = specs(
        ["--nproc-per-node", "2", "--role", "trainer", "--virtual-local-rank"], tmp_path, cvd="3,5"
    )
    assert [w.env["ROLE_NAME"] for w in workers] == ["trainer", "trainer"]
    assert [w.env["LOCAL_RANK"] for w in workers] == ["0", "0"]
    assert [w.env["RANK"] for w in workers] == ["0", "1"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["3", "5"]


def test_numa_binding_on_cpu_workers_shares_the_cores(tmp_path: Path) -> None:
    workers = specs(["--nproc-per-node", "2", "--numa-binding", "node"], tmp_path)
    chosen = [set(map(int, w.env[AFFINITY_ENV].split(","))) for w in workers]
    assert all(chosen) and (len(chosen[0] & chosen[1]) == 0 or len(chosen[0]) == 1)


def test_worker_argv_per_mode(tmp_path: Path) -> None:
    config, _ = parse_run_args(["--no-python", "echo", "a"], {})
    assert worker_argv(config) == [sys.executable, "-m", "multigpu.rank", "exec", "echo", "a"]
    script = tmp_path / "t.py"
    script.write_text("")
    config, _ = parse_run_args(["--run-path", str(script), "x"], {})
    assert worker_argv(config)[3:] == ["script", str(script), "x"]


def test_duplicate_filters_copy_only_teed_streams_of_shown_ranks(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    argv = [
        "--nproc-per-node",
        "3",
        "--log-dir",
        str(logs),
        "-t",
        "1",
        "--local-ranks-filter",
        "0,2",
        "--duplicate-stdout-filters",
        "loss,,acc",
        "--duplicate-stderr-filters",
        "warn",
        "--role",
        "trainer",
    ]
    workers = specs(argv, tmp_path)
    attempt = run_dir(logs) / "attempt_1"
    by_rank = {w.local_rank: {c.stream: c for c in w.line_copies} for w in workers}
    assert {c.path for copies in by_rank.values() for c in copies.values()} == {
        attempt / "filtered_stdout.log",
        attempt / "filtered_stderr.log",
    }
    assert by_rank[0]["stdout"].needles == (b"loss,acc",) and by_rank[0]["stdout"].header == b"[trainer0]:"
    assert by_rank[1]["stdout"].needles == ()  # --local-ranks-filter hides rank 1: nothing copied
    assert by_rank[2]["stderr"].needles == ()  # stderr is not teed (-t 1): nothing copied
    assert by_rank[2]["stdout"].matching([b"loss,acc 0.5", b"loss 0.5"]) == b"[trainer2]:loss,acc 0.5\n"
    from multigpu.runner.torchrun_rules import RankLogs, line_copies

    config = parse_run_args([*argv, str(tmp_path / "train.py")], {})[0]
    teed = RankLogs({"stdout": tmp_path / "o"}, frozenset({"stdout"}))
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name} ${rank}/${local_rank}]:"}
    (copy,) = line_copies(config, 2, 7, teed, tmp_path, env)[:1]
    assert copy.header == b"[trainer 7/2]:"


def test_without_a_log_folder_duplicate_filters_copy_nothing(tmp_path: Path) -> None:
    assert all(
        w.line_copies == ()
        for w in specs(["--nproc-per-node", "2", "--duplicate-stdout-filters", "x"], tmp_path)
    )
