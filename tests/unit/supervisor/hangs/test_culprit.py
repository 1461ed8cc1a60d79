"""The stuck rank named from the stacks every rank dumped (``supervisor/hangs/culprit.py``), on dumps in
faulthandler's format as a forked rank writes them."""

from __future__ import annotations

from multigpu.supervisor.hangs.culprit import find_culprits, main_thread

SITE = "/venv/lib/python3.11/site-packages/torch/distributed"
WATCHER = """Thread 0x00007fd68f13e6c0 (most recent call first):
  File "/work/main/src/multigpu/rank/guard.py", line 57 in _watch_parent
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

"""
TAIL = """  File "<frozen runpy>", line 291 in run_path
  File "/work/main/src/multigpu/rank/bootstrap.py", line 53 in run_script
  File "/work/main/src/multigpu/template/__main__.py", line 8 in <module>
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
WAITS = (
    WATCHER
    + f"""Current thread 0x00007fd6a9be2b80 (most recent call first):
  File "{SITE}/distributed_c10d.py", line 3252 in all_reduce
  File "{SITE}/c10d_logger.py", line 83 in wrapper
  File "/job/train.py", line 9 in <module>
"""
    + TAIL
)
SLEEPS = (
    WATCHER
    + """Current thread 0x00007fd6a9be2b80 (most recent call first):
  File "/job/train.py", line 8 in <module>
"""
    + TAIL
)


def test_the_main_thread_is_the_one_not_started_by_threading() -> None:
    frames = main_thread(SLEEPS.splitlines())
    assert frames[0].path == "/job/train.py" and frames[0].line == 8


def test_the_rank_outside_the_collective_is_named_with_its_frame() -> None:
    found = find_culprits({0: WAITS.splitlines(), 1: SLEEPS.splitlines(), 2: WAITS.splitlines()})
    assert found is not None and found.ranks == [1]
    assert found.line == (
        "rank 1 never reached the all_reduce that ranks 0, 2 wait in: rank 1 is in /job/train.py:8 (<module>)"
    )


def test_several_culprits_are_each_named() -> None:
    found = find_culprits({0: SLEEPS.splitlines(), 1: SLEEPS.splitlines(), 2: WAITS.splitlines()})
    assert found is not None and found.ranks == [0, 1]
    assert found.line.startswith("ranks 0, 1 never reached the all_reduce that rank 2 waits in: rank 0 is")


def test_no_culprit_when_all_wait_or_none_does_or_a_stack_is_missing() -> None:
    assert find_culprits({0: WAITS.splitlines(), 1: WAITS.splitlines()}) is None
    assert find_culprits({0: SLEEPS.splitlines(), 1: SLEEPS.splitlines()}) is None
    assert find_culprits({0: WAITS.splitlines(), 1: []}) is None  # rank 1 never answered the dump
