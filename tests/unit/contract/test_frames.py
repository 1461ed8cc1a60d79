"""Which frames are multigpu's own: one rule, by module, for the bootstrap, function mode and restarts."""

from __future__ import annotations

import os
import sys
import traceback

import multigpu.runner.crash_loop
from multigpu.contract.failure import WorkerFailure
from multigpu.contract.frames import library_file, module_of_file, own_file, own_frame, own_module
from multigpu.rank.bootstrap import user_frames
from multigpu.runner.crash_loop import signature


def test_own_modules_are_the_package() -> None:
    assert own_module("multigpu") and own_module("multigpu.supervisor.loop")
    assert own_module("multigpu.cli.demo")
    assert not own_module("multigpugadget") and not own_module("__main__") and not own_module(None)


def test_a_file_is_named_by_its_module() -> None:
    assert module_of_file(multigpu.runner.crash_loop.__file__) == "multigpu.runner.crash_loop"
    assert module_of_file(os.path.join(os.path.dirname(multigpu.__file__), "__init__.py")) == "multigpu"
    assert module_of_file(__file__) is None
    assert own_file(multigpu.runner.crash_loop.__file__) and not own_file(__file__)
    assert library_file(os.__file__) and library_file("<frozen runpy>") and not library_file(__file__)


def test_frames_are_ours_by_the_module_they_run_in() -> None:
    frame = sys._getframe()
    assert not own_frame(frame)
    namespace: dict[str, object] = {"__name__": "multigpu.runner.attempt"}
    exec("import sys\nf = sys._getframe()", namespace)
    assert own_frame(namespace["f"])  # type: ignore[arg-type]


def test_the_bootstrap_and_the_restart_policy_skip_the_same_frames() -> None:
    def user() -> None:
        raise ValueError("boom")

    namespace: dict[str, object] = {"__name__": "multigpu.rank.bootstrap", "user": user}
    try:
        exec("def start():\n    user()\nstart()", namespace)
    except ValueError as exc:
        tb = exc.__traceback__
        assert tb is not None
        kept = user_frames(tb.tb_next)  # from the exec'd "bootstrap" frame on
        assert kept is not None and kept.tb_frame.f_code.co_name == "user"
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    failure = WorkerFailure(rank=0, local_rank=0, pid=1, error_type="ValueError", traceback=text)
    found = signature(failure)
    assert found is not None and found.where.startswith(__file__ + ":")


def test_fold_own_frames_keeps_the_users_and_folds_runs_of_ours() -> None:
    """Issue 22: the report shows the user's frames; each run of ours is one line (both formats)."""
    from multigpu.contract.frames import PACKAGE_DIR, fold_own_frames

    ours = f"{PACKAGE_DIR}/rank/bootstrap.py"
    dump = "\n".join(
        [
            "Current thread 0x01 (most recent call first):",
            '  File "train.py", line 13 in <module>',
            f'  File "{ours}", line 46 in write_error_file',
            f'  File "{PACKAGE_DIR}/template/child.py", line 150 in run_bootstrap',
            '  File "<frozen runpy>", line 88 in _run_code',
        ]
    )
    assert fold_own_frames(dump).splitlines() == [
        "Current thread 0x01 (most recent call first):",
        '  File "train.py", line 13 in <module>',
        "  ... 2 multigpu frames ...",
        '  File "<frozen runpy>", line 88 in _run_code',
    ]
    traceback = "\n".join(
        [
            "Traceback (most recent call last):",
            f'  File "{ours}", line 46, in main',
            "    run()",
            "    ^^^^^",
            '  File "train.py", line 3, in step',
            "    raise ValueError('x')",
            "ValueError: x",
        ]
    )
    assert fold_own_frames(traceback).splitlines() == [
        "Traceback (most recent call last):",
        "  ... 1 multigpu frame ...",
        '  File "train.py", line 3, in step',
        "    raise ValueError('x')",
        "ValueError: x",
    ]


def test_a_stack_dump_in_the_report_leaves_out_our_own_threads() -> None:
    """The rank's dump thread and parent watch are ours: a hang report shows the user's threads (a
    thread of the user's that runs through our code stays), and says how many it left out."""
    from multigpu.contract.frames import PACKAGE_DIR, fold_own_threads

    threading_py = "/usr/lib/python3.11/threading.py"
    ours = [
        f'  File "{PACKAGE_DIR}/rank/dump_signal.py", line 57 in _answer_dumps',
        f'  File "{threading_py}", line 982 in run',
        f'  File "{threading_py}", line 1002 in _bootstrap',
    ]
    users = ['  File "loader.py", line 9 in fetch', f'  File "{threading_py}", line 982 in run']
    main = [
        '  File "train.py", line 13 in <module>',
        f'  File "{PACKAGE_DIR}/rank/bootstrap.py", line 1 in main',
    ]
    dump = "\n".join(
        [
            "Thread 0x02 (most recent call first):",
            *ours,
            "",
            "Current thread 0x03 (most recent call first):",
            *ours,
            "",
            "Thread 0x04 (most recent call first):",
            *users,
            "",
            "Thread 0x01 (most recent call first):",
            *main,
        ]
    )
    assert fold_own_threads(dump).splitlines() == [
        "Thread 0x04 (most recent call first):",
        *users,
        "",
        "Thread 0x01 (most recent call first):",
        *main,
        "... 2 multigpu threads ...",
    ]
    assert fold_own_threads("\n".join(["Thread 0x01 (most recent call first):", *main])) == "\n".join(
        ["Thread 0x01 (most recent call first):", *main]
    )
