"""``multigpu.spawn``'s errors are torch's own; what a rank calls is ``fn(i, *args)``. No processes."""

from __future__ import annotations

import pytest
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

import multigpu
from multigpu.contract.errors import WorkerFailedError
from multigpu.contract.failure import WorkerFailure
from multigpu.function.launch_errors import RemoteTraceback
from multigpu.function.spawning import as_torch_error, call_with_index, raise_as_torch


def test_the_names_are_torchs() -> None:
    assert multigpu.ProcessRaisedException is ProcessRaisedException
    assert multigpu.ProcessExitedException is ProcessExitedException


def test_a_raised_exception_becomes_process_raised_exception() -> None:
    original = KeyError("x")
    original.__cause__ = RemoteTraceback("Traceback ...\nKeyError: 'x'", 1, 42)
    error = as_torch_error(original)
    assert isinstance(error, ProcessRaisedException) and error.error_index == 1 and error.error_pid == 42
    assert "-- Process 1 terminated with the following error:\nTraceback ...\nKeyError: 'x'" in str(error)


def test_a_death_becomes_process_exited_exception() -> None:
    killed = as_torch_error(
        WorkerFailedError(WorkerFailure(rank=0, local_rank=0, pid=7, exit_code=-9, signal="SIGKILL"))
    )
    assert isinstance(killed, ProcessExitedException) and killed.signal_name == "SIGKILL"
    assert killed.exit_code == -9 and killed.msg == "process 0 terminated with signal SIGKILL"  # torch's
    exited = as_torch_error(WorkerFailedError(WorkerFailure(rank=1, local_rank=1, pid=8, exit_code=3)))
    assert isinstance(exited, ProcessExitedException) and exited.exit_code == 3 and exited.error_index == 1


def test_other_errors_pass_unchanged() -> None:
    interrupt = KeyboardInterrupt()
    assert as_torch_error(interrupt) is interrupt


def test_fn_gets_its_index_first_and_no_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert call_with_index(lambda i, a, b: (i, a, b), ("a", "b")) == (1, "a", "b")
    import os

    assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ


@pytest.mark.parametrize("nprocs", [2, 4, 6])
def test_spawn_assigns_no_gpu_so_every_process_sees_every_gpu(
    monkeypatch: pytest.MonkeyPatch, nprocs: int
) -> None:
    """As ``torch.multiprocessing.spawn``: with 4 GPUs visible, 2, 4 or 6 processes all keep the caller's
    ``CUDA_VISIBLE_DEVICES`` (no GPU list for the launcher to cut it to), never a silent change of kind."""
    import multigpu.function.launch_config as lc
    import multigpu.function.spawning as spawning
    from multigpu.cluster.devices import GPUInfo
    from multigpu.function.launch_call import Launch

    found = [GPUInfo(index=i, ordinal=str(i), name="gpu", uuid=f"GPU-{i}") for i in range(4)]
    monkeypatch.setattr(lc, "visible_gpus", lambda env=None: found)
    monkeypatch.setattr(spawning, "visible_gpus", lambda env=None: found, raising=False)
    seen = []

    def wait(self: Launch) -> list[object]:
        seen.append(self.config)
        self.remove()
        return []

    monkeypatch.setattr(Launch, "wait", wait)
    multigpu.spawn(print, nprocs=nprocs)
    assert seen[0].nproc == nprocs and seen[0].gpus == () and seen[0].device == "cpu"


def test_a_raised_exception_prints_one_traceback_and_keeps_the_ranks_exception() -> None:
    """torch's message holds the rank's traceback: the remote one is not chained again below it."""
    original = KeyError("x")
    original.__cause__ = RemoteTraceback("Traceback ...\nKeyError: 'x'", 1, 42)
    with pytest.raises(ProcessRaisedException) as raised:
        raise_as_torch(original)
    assert raised.value.__cause__ is original and original.__cause__ is None


def test_an_exit_is_raised_alone_as_torch_raises_it() -> None:
    failed = WorkerFailedError(WorkerFailure(rank=1, local_rank=1, pid=8, exit_code=3))
    with pytest.raises(ProcessExitedException) as raised:
        raise_as_torch(failed)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert raised.value.msg == "process 1 terminated with exit code 3"


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_start_method_other_than_spawn_warns_as_torch_does(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    from multigpu.function.launch_call import Launch

    monkeypatch.setattr(Launch, "wait", lambda self: self.remove() or [])
    with pytest.warns(FutureWarning, match=f"only supports start_method=spawn \\(got: {method}\\)"):
        multigpu.spawn(print, nprocs=2, start_method=method)
