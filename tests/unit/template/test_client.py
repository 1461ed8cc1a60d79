"""The warm template's parts that need no running template: the adopted-child handle, the shared
environment, the fallback when a template cannot start, the forked rank's descriptor set-up and exit
status, and the command-line options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import assert_gone, logged
from multigpu.cli.run_args import parse_run_args
from multigpu.contract.errors import UsageError
from multigpu.supervisor.spawning import AdoptedProcess
from multigpu.supervisor.states import WorkerSpec
from multigpu.template.child import exit_code
from multigpu.template.client import NodeSpawner, forkable, shared_env

pytestmark = pytest.mark.timeout(60)


def spawned(code: str) -> AdoptedProcess:
    """A child started without Popen, so only the handle under test waits for it."""
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], dict(os.environ))
    null = open(os.devnull, "rb")  # noqa: SIM115 - closed below by each test
    return AdoptedProcess(pid, null, null)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import sys; sys.exit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ],
)
def test_an_adopted_child_reports_its_status_as_popen_would(code: str, expected: int) -> None:
    child = spawned(code)
    try:
        assert child.wait(timeout=30) == expected
        assert child.poll() == expected and child.returncode == expected
    finally:
        assert child.stdout is not None
        child.stdout.close()
    assert_gone([child.pid])


@pytest.mark.integration
def test_an_adopted_child_times_out_like_popen() -> None:
    child = spawned("import time; time.sleep(30)")
    try:
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    finally:
        assert child.stdout is not None
        child.stdout.close()
    assert_gone([child.pid])


def spec(rank: int, env: dict[str, str], mode: str = "script") -> WorkerSpec:
    return WorkerSpec(
        rank=rank, local_rank=rank, env=env, argv=[sys.executable, "-m", "multigpu.rank", mode, "job.py"]
    )


def test_the_template_gets_what_every_rank_shares() -> None:
    specs = [
        spec(0, {"RANK": "0", "OMP_NUM_THREADS": "1", "PATH": "/bin"}),
        spec(1, {"RANK": "1", "OMP_NUM_THREADS": "1", "PATH": "/bin", "ONLY": "1"}),
    ]
    assert shared_env(specs) == {"OMP_NUM_THREADS": "1", "PATH": "/bin"}


def test_only_python_ranks_of_our_bootstrap_are_forked() -> None:
    assert forkable(spec(0, {})) and forkable(spec(0, {}, "module"))
    assert forkable(spec(0, {}, "function"))  # multigpu.launch's ranks
    assert not forkable(spec(0, {}, "exec"))
    assert not forkable(WorkerSpec(rank=0, local_rank=0, env={}, argv=["/bin/true"]))
    check = [sys.executable, "-m", "multigpu.preflight", "{}"]
    assert forkable(WorkerSpec(rank=-1, local_rank=-1, env={}, argv=check))  # the node's preflight check


@pytest.mark.integration
def test_a_template_that_cannot_start_means_plain_processes_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spawner = NodeSpawner(use_template=True, store=None, python="/bin/false")
    plain = WorkerSpec(rank=0, local_rank=0, env={}, argv=[sys.executable, "-c", "pass"])
    try:
        spawner.start({"PATH": os.environ.get("PATH", "")})
        spawner.prepare([spec(0, {})])
        spawner.prepare([spec(0, {})])  # a restart: nothing more to say
        assert spawner.template is None
        child = spawner.spawn(plain, {"PATH": os.environ.get("PATH", "")}, ())
        assert child.wait(timeout=30) == 0
        for pipe in (child.stdout, child.stderr):
            assert pipe is not None
            pipe.close()
    finally:
        spawner.close()
    notes = logged(caplog)
    assert len(notes) == 1, notes
    assert "template failed to start" in notes[0] and "plain processes" in notes[0]
    assert_gone([child.pid])


PLACE = """
import json, os, socket, sys
from multigpu.template.child import place_descriptors
a_r, a_w = os.pipe()
b_r, b_w = os.pipe()
ctl, other = socket.socketpair()
stray = os.open(os.devnull, os.O_RDONLY)  # something the template had open
place_descriptors([a_w, b_w, a_r], [1, 2, 9], ctl.detach())
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
seen = {f: os.readlink(f"/proc/self/fd/{f}") for f in fds if os.path.exists(f"/proc/self/fd/{f}")}
with open("fds.json", "w") as out:  # stdout and stderr are pipes nobody reads now
    json.dump(seen, out)
"""


@pytest.mark.integration
def test_a_forked_rank_keeps_exactly_its_descriptors(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PLACE)],
        capture_output=True,
        timeout=30,
        pass_fds=(),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    fds = {int(k): v for k, v in json.loads((tmp_path / "fds.json").read_text()).items()}
    assert set(fds) == {0, 1, 2, 9}  # listdir's own descriptor is closed by now
    assert fds[0] == os.devnull
    assert fds[1].startswith("pipe:") and fds[9] == fds[1]  # both ends of one pipe
    assert fds[2].startswith("pipe:") and fds[2] != fds[1]


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (256 + 7, 7), ("bye", 1)])
def test_a_forked_rank_ends_with_the_status_a_fresh_interpreter_would(
    code: object, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code(SystemExit(code)) == status
    if isinstance(code, str):
        assert capsys.readouterr().err == "bye\n"


def test_template_options(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text("")
    config, _ = parse_run_args([str(job)], {})
    assert config.supervision.template and config.supervision.preload == ()
    config, _ = parse_run_args(["--no-template", "--preload", "numpy, json.decoder", str(job)], {})
    assert not config.supervision.template and config.supervision.preload == ("numpy", "json.decoder")
    config, _ = parse_run_args([str(job)], {"MULTIGPU_NO_TEMPLATE": "1"})
    assert not config.supervision.template
    with pytest.raises(UsageError, match="--preload takes module names"):
        parse_run_args(["--preload", "not-a-module", str(job)], {})


FORK = """
import json, os, socket, sys
from multigpu.contract.prctl import set_child_subreaper
from multigpu.template import server

def as_rank(request, fds, control, middle, pools):
    # stands in for become_rank: the real wait for re-parenting, then what the rank was told
    server_child.wait_for_launcher(middle)
    with open("rank.json", "w") as out:
        json.dump({"middle": middle, "ppid": os.getppid(), "pid": os.getpid()}, out)
    os._exit(0)

from multigpu.template import child as server_child
server.become_rank = as_rank
set_child_subreaper()  # as the launcher is: the rank is re-parented here
ctl, other = socket.socketpair()
answer = server.fork_rank({}, [], ctl, server.Pools())
os.waitpid(answer["pid"], 0)
print(json.dumps({"launcher": os.getpid(), **answer}))
"""


@pytest.mark.integration
def test_a_forked_rank_is_told_its_middle_process_by_the_middle_itself(tmp_path: Path) -> None:
    """Read by the rank, the middle's pid was the launcher's whenever the middle exited first, and
    the rank then waited 5 s for a re-parenting that had already happened."""
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORK)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    launcher = json.loads(res.stdout)
    rank = json.loads((tmp_path / "rank.json").read_text())
    assert rank["pid"] == launcher["pid"]
    assert rank["middle"] not in (launcher["launcher"], rank["pid"])
    assert rank["ppid"] == launcher["launcher"]  # re-parented before the bootstrap runs
    assert "did not exit" not in res.stderr


def test_the_template_holds_every_pool_to_one_thread_whatever_the_ranks_get() -> None:
    from multigpu.template.pools import HELD, held

    env = held({"OMP_NUM_THREADS": "8", "OPENBLAS_NUM_THREADS": "4", "PATH": "/bin"})
    assert env["PATH"] == "/bin" and all(env[name] == "1" for name in HELD)
    assert {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"} <= set(HELD)


def test_a_rank_sizes_a_pool_from_the_first_variable_its_library_reads() -> None:
    from multigpu.template.pools import BLAS_READS, TORCH_READS, wanted

    openblas = BLAS_READS["openblas"]
    assert wanted(openblas, {"OMP_NUM_THREADS": "3"}, 9) == 3
    assert wanted(openblas, {"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "3"}, 9) == 2
    assert wanted(openblas, {"OMP_NUM_THREADS": "4,2"}, 9) == 4  # OpenMP's nested list: the first level
    assert wanted(openblas, {"OMP_NUM_THREADS": "0"}, 9) == 9  # not a count: the library's default
    assert wanted(openblas, {}, 9) == 9
    assert wanted(TORCH_READS, {"MKL_NUM_THREADS": "5", "OMP_NUM_THREADS": "3"}, 9) == 5  # torch: MKL wins


class NoForks:
    """A template stand-in whose forks fail as ``TemplateProcess.fork`` raises them."""

    def __init__(self, exc: OSError) -> None:
        self.exc = exc

    def fork(self, *args: object) -> int:
        raise self.exc

    def spawn(self, *args: object) -> int:
        raise self.exc

    def pids(self) -> frozenset[int]:
        return frozenset()


def test_the_templates_fork_answer_carries_forks_errno() -> None:
    from multigpu.template.server import fork_answer

    assert fork_answer("4242") == {"pid": 4242}
    assert fork_answer("errno 11") == {"error": f"the fork failed: {os.strerror(11)}", "errno": 11}
    assert fork_answer("") == {"error": "the fork failed"}


def test_a_template_at_the_process_limit_ends_the_start_in_one_error_not_a_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 43: the template's fork hit the process limit; the launcher fell back to plain processes,
    whose fork failed too, with a ``BlockingIOError`` traceback. Now: one ``ProcessLimitError`` naming
    the rank, no fallback, and no descriptor of the attempt left open."""
    from multigpu.supervisor.spawning import ProcessLimitError, start_rank

    spawner = NodeSpawner(use_template=False, store=None)
    spawner._template = NoForks(BlockingIOError(11, os.strerror(11)))  # type: ignore[assignment]
    rank = spec(7, {})
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(ProcessLimitError) as raised:
        start_rank(spawner, rank)
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert str(raised.value).startswith(
        f"cannot start rank 7: the process limit was reached ({os.strerror(11)}; "
    ), str(raised.value)
    assert logged(caplog) == []  # no "plain processes from here on"


def test_a_template_fork_failing_otherwise_still_falls_back_to_plain_processes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spawner = NodeSpawner(use_template=False, store=None)
    spawner._template = NoForks(OSError("fork failed: MemoryError: "))  # type: ignore[assignment]
    spawner._plain = NoForks(OSError("stop here"))  # type: ignore[assignment]
    with pytest.raises(OSError, match="stop here"):
        spawner.spawn(spec(0, {}), {}, ())
    notes = logged(caplog)
    assert len(notes) == 1 and "could not fork rank 0" in notes[0] and "plain processes" in notes[0], notes
