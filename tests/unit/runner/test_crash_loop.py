"""The restart policy: a root cause that repeats (type and innermost user frame) stops the restarts."""

from __future__ import annotations

import sysconfig

from multigpu.contract.exitcodes import EXIT_CRASH_LOOP
from multigpu.contract.failure import FailureKind, Subject, WorkerFailure
from multigpu.runner.crash_loop import CrashLoopPolicy, Signature, signature

LIB = sysconfig.get_paths()["purelib"]


def _traceback(*frames: tuple[str, int], error: str = "ValueError: bad") -> str:
    lines = ["Traceback (most recent call last):"]
    for path, line in frames:
        lines += [f'  File "{path}", line {line}, in f', "    code()"]
    return "\n".join([*lines, error]) + "\n"


TRAIN = (("/w/train.py", 12),)


def failure(
    error_type: str | None = "ValueError", frames: tuple[tuple[str, int], ...] = TRAIN, rank: int = 1
) -> WorkerFailure:
    tb = _traceback(*frames) if frames else None
    return WorkerFailure(
        rank=rank, local_rank=rank, pid=100, exit_code=1, error_type=error_type, message="bad", traceback=tb
    )


def test_signature_is_the_type_and_the_innermost_user_frame() -> None:
    deep = failure(
        "RuntimeError", (("/w/train.py", 40), ("/w/model.py", 7), (f"{LIB}/torch/distributed/c10d.py", 2000))
    )
    assert signature(deep) == Signature("RuntimeError", "/w/model.py:7")
    assert str(signature(deep)) == "RuntimeError at /w/model.py:7"
    in_library_only = failure("OSError", ((f"{LIB}/pkg/io.py", 3),))
    assert signature(in_library_only) == Signature("OSError", f"{LIB}/pkg/io.py:3")


def test_failures_that_name_no_place_have_no_signature() -> None:
    assert signature(None) is None
    assert signature(failure(error_type=None)) is None  # exit code only (sys.exit(1))
    assert signature(failure(frames=())) is None
    killed = WorkerFailure(rank=0, local_rank=0, pid=1, signal="SIGKILL")
    dump = 'Thread 0x1 (most recent call first):\n  File "/w/train.py", line 9 in f\n'  # faulthandler's
    hung = WorkerFailure(
        rank=0, local_rank=0, pid=1, error_type=FailureKind.HANG, message="stuck", traceback=dump
    )
    assert signature(killed) is None and signature(hung) is None


def test_the_same_failure_twice_in_a_row_is_a_loop() -> None:
    policy = CrashLoopPolicy()
    assert policy.check(failure()) is None
    line = policy.check(failure(rank=1))
    assert line is not None and "\n" not in line
    assert line.startswith("crash loop: rank 1 failed with ValueError at /w/train.py:12 on two attempts")
    assert f"exit {EXIT_CRASH_LOOP}" in line


def test_a_changing_failure_keeps_its_restarts() -> None:
    policy = CrashLoopPolicy()
    sequence = [
        failure(),
        failure("KeyError"),
        failure(frames=(("/w/train.py", 13),)),
        WorkerFailure(rank=0, local_rank=0, pid=1, signal="SIGKILL"),
        failure(),
        WorkerFailure.launcher_named(Subject.NODE, FailureKind.NODE_LOST, "node 1 stopped beating", node=1),
        failure(),
    ]
    assert [policy.check(f) for f in sequence] == [None] * len(sequence)
    assert policy.check(failure()) is not None  # ...until it repeats
