"""Every command in the user guide (``docs/*.md``) is run here, on this machine, with CPU workers.

Conventions of the guide's fenced blocks (also described in ``docs/README.md``):

- Only `````bash`` blocks are run (`````text`` blocks hold pasted output, `````python`` blocks code).
- One command per line, written without a ``$ `` prompt (a ``$ `` prefix is an error here, so there is
  one convention); blank lines and lines starting with ``#`` are comments; no ``\\`` continuations.
- A command must exit 0, unless its line ends in ``# exit N``.
- A comment line ``# expect: TEXT`` right after a command: its stdout+stderr contains ``TEXT``.
- ``$HOST``, ``$PORT`` and ``$BUSY_PORT`` are environment variables set here: ``127.0.0.1``, a free
  port, and a port this test holds listening for the block's duration.
- A line ending in ``# not run here: REASON`` is a command the test does not run (it says why).
- ``README.md``'s blocks are checked too, with two more kinds: ``venv`` (a ``python3 -m venv .venv &&
  .venv/bin/pip install ... && COMMAND`` chain: a venv is made in a scratch folder, the install is
  a ``--dry-run`` as in ``setup``, the command runs) and ``repo`` (commands run in the repository).
  A ``pytest`` command is collected, not run (``--collect-only``): it would run this test again.
- Block kinds, by the word after ``bash``: none (run line by line, in order), ``nodes`` (every line is
  one machine's command: all are started at once, on 127.0.0.1), ``gpu`` (run only when a GPU is
  visible), ``setup`` (``pip install`` lines, run with ``--dry-run --no-deps --no-index
  --no-build-isolation`` in the repository), ``sbatch`` (a SLURM batch script: it must equal
  ``docs/examples/multigpu.sbatch``, and its ``srun`` line's command runs under recorded SLURM
  environments: one node, and two launcher tasks on ``localhost``).
- ``NOTEBOOK_PAGES`` (``notebooks.md``): its `````python`` blocks are cells, run in order in one real
  Jupyter kernel (``jupyter_client`` + ipykernel); each must finish without an error (they assert
  what they show), and once the kernel is shut down nothing it started is left.

Commands run with ``bash -c`` in a temporary copy of ``examples/``, one per block: the suite runs under
pytest-xdist, where a block cannot count on another block having run in the same folder, so each block
is self-contained. The venv's ``bin`` is first on ``PATH``, and ``.venv/bin/`` in a command names it
(the README's venv). Each command is bounded by a timeout and started in its own session; afterwards its
session and every worker PID in the run records it wrote must be gone, and a command that starts no run
(not ``multigpu``, ``torchrun``, ``python examples/...``) must leave every run record as it was: a
documented ``python -m json.tool a.json b.json`` once wrote one run's record over another's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import assert_gone, clean_env, free_port
from notebook_kernel import Kernel

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SBATCH = DOCS / "examples" / "multigpu.sbatch"
BIN = Path(sys.executable).parent
COMMAND_TIMEOUT = 90.0

pytestmark = [pytest.mark.slow, pytest.mark.integration]

_FENCE = re.compile(r"^```bash(?P<kind>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_EXIT = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")
_EXPECT = "# expect:"
KINDS = {"", "nodes", "gpu", "setup", "sbatch", "venv", "repo"}
_NOT_RUN = re.compile(r"#\s*not run here:\s*(\S.*)$")
_COMMENT = re.compile(r"\s+#\s.*$")
DRY_RUN = " --dry-run --no-deps --no-index --no-build-isolation"


@dataclass
class Command:
    text: str
    line: int
    exit_code: int = 0
    expects: list[str] = field(default_factory=list)
    not_run: str | None = None
    """Why the test does not run it (``# not run here: REASON``)."""


@dataclass
class Block:
    page: str
    line: int
    kind: str
    body: str
    commands: list[Command]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}" + (f"[{self.kind}]" if self.kind else "")


def parse_block(page: str, line: int, kind: str, body: str) -> Block:
    if kind not in KINDS:
        raise ValueError(f"{page}:{line}: unknown block kind 'bash {kind}'")
    commands: list[Command] = []
    for offset, raw in enumerate(body.splitlines(), start=1):
        text = raw.strip()
        where = f"{page}:{line + offset}"
        if kind == "sbatch":
            if text.startswith("srun "):
                commands.append(Command(text, line + offset))
            continue
        if text.startswith(_EXPECT):
            if not commands:
                raise ValueError(f"{where}: '# expect:' before any command")
            commands[-1].expects.append(text[len(_EXPECT) :].strip())
            continue
        if not text or text.startswith("#"):
            continue
        if text.startswith("$ "):
            raise ValueError(f"{where}: write commands without a '$ ' prompt")
        if text.endswith("\\"):
            raise ValueError(f"{where}: one command per line, no continuations")
        match = _EXIT.search(text)
        code = int(match.group(1)) if match else 0
        skip = _NOT_RUN.search(text)
        commands.append(
            Command(
                text[: match.start()] if match else text,
                line + offset,
                code,
                not_run=skip.group(1) if skip else None,
            )
        )
    if not commands:
        raise ValueError(f"{page}:{line}: a bash block without a command")
    return Block(page, line, kind, body, commands)


def collect_blocks() -> list[Block]:
    blocks = []
    for path in [*sorted(DOCS.glob("*.md")), README]:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            blocks.append(parse_block(path.name, line, m.group("kind").strip(), m.group("body")))
    return blocks


BLOCKS = collect_blocks()

HEAVY = {
    ("migrating.md", "torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --steps 5"),
    ("migrating.md", "python examples/manager.py --cpu 2"),
    (
        "multinode.md",
        "srun --ntasks-per-node=1 multigpu run --output runs/$SLURM_JOB_ID examples/train_ddp.py --steps 20",
    ),
    ("README.md", "multigpu run examples/train_ddp.py --steps 5"),
    ("quickstart.md", "multigpu run --cpu 2 examples/train_ddp.py --steps 5"),
}
"""The blocks (page, first command) that start several real jobs, 30 s or more in the suite: they run in
the heavy tier after it (``scripts/fault_matrix.sh``), so the suite stays under 8 minutes. Named by
their first command, not a line number, so that editing a page does not move a block between tiers."""

CI_LINES = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
"""A command ``.ci/run`` runs word for word after the suite (the README's lint line) is not run twice."""


def first_command(block: Block) -> tuple[str, str]:
    """(page, its first command without a trailing comment): how ``HEAVY`` names a block."""
    return block.page, _COMMENT.sub("", block.commands[0].text)


def tier(block: Block) -> object:
    heavy = first_command(block) in HEAVY
    return pytest.param(block, id=block.id, marks=[pytest.mark.matrix] if heavy else [])


def test_every_heavy_block_is_in_the_guide() -> None:
    found = {first_command(b) for b in BLOCKS}
    assert found >= HEAVY, HEAVY - found


def gpu_visible() -> bool:
    from multigpu.cluster.devices import visible_gpus

    return bool(visible_gpus())


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh copy of the examples for one block."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield int(s.getsockname()[1])


def command_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _records(cwd: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in cwd.rglob("run*.json")}


def _contents(cwd: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in cwd.rglob("run*.json")}


LAUNCHERS = ("multigpu ", "torchrun ", "python examples/", "srun ")


def starts_no_run(text: str) -> bool:
    """A command that launches nothing (after any ``VAR=value`` prefix): it must not touch a record."""
    words = [w for w in shlex.split(text.split("#")[0]) if "=" not in w.split("/")[0]] or [""]
    return not " ".join(words).startswith(LAUNCHERS)


def venv_named(text: str) -> str:
    """``.venv/bin/`` in a documented command is the README's venv: the one running this test; a
    ``pytest`` command is collected only (running it would run this test again)."""
    text = text.replace(".venv/bin/", f"{BIN}/")
    return f"{_COMMENT.sub('', text)} --collect-only -q" if " -m pytest" in text else text


def run_venv_chain(block: Block, cmd: Command, cwd: Path, env: Mapping[str, str]) -> None:
    """The README's ``python3 -m venv .venv && .venv/bin/pip install ... && COMMAND``, part by part."""
    for part in cmd.text.split(" && "):
        if part.startswith("python3 -m venv "):  # made for real, without pip, in a scratch folder
            run_together(
                block, [Command(f"python3 -m venv --without-pip {cwd / 'venv'}", cmd.line)], cwd, [env]
            )
        elif "pip install" in part:
            dry = Command(part + DRY_RUN, cmd.line, expects=["Would install multigpu"])
            run_together(block, [dry], ROOT, [env], records=False)
        else:
            here = ROOT if " -m pytest" in part else cwd
            run_together(
                block, [Command(part, cmd.line, cmd.exit_code, cmd.expects)], here, [env], records=here is cwd
            )


def _worker_pids(cwd: Path, before: Mapping[Path, float]) -> list[int]:
    import json

    pids = []
    for path, mtime in _records(cwd).items():
        if before.get(path) == mtime:
            continue
        for attempt in json.loads(path.read_text()).get("attempts", []):
            pids += [r["pid"] for r in attempt["ranks"].values() if r.get("pid")]
    return pids


def _session_gone(pgid: int, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def start(command: str, cwd: Path, env: Mapping[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int | None, str]:
    """The exit code (None on timeout, after killing the session) and the output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def torch_exit_abort(cmd: Command, code: int | None, out: str) -> bool:
    """torchrun's rank aborted in torch's C++ teardown after the work was done (issue 12): the doc's
    expected output is all there, and torchrun names SIGABRT. The work is judged, not that abort."""
    return (
        cmd.text.startswith("torchrun ")
        and code not in (None, cmd.exit_code)
        and "SIGABRT" in out
        and bool(cmd.expects)
        and all(text in out for text in cmd.expects)
    )


def check(cmd: Command, code: int | None, out: str, block: Block) -> None:
    where = f"{block.page}:{cmd.line}: {cmd.text}"
    assert code is not None, f"{where}\ntimed out after {COMMAND_TIMEOUT:g}s; output:\n{out[-3000:]}"
    if torch_exit_abort(cmd, code, out):
        print(f"{where}: torchrun's rank aborted at exit after the work was done (SIGABRT); judged done")
        return
    assert code == cmd.exit_code, (
        f"{where}\nexit {code}, the doc says {cmd.exit_code}; output:\n{out[-3000:]}"
    )
    for text in cmd.expects:
        assert text in out, f"{where}\noutput lacks {text!r}:\n{out[-3000:]}"


def run_together(
    block: Block, commands: list[Command], cwd: Path, envs: list[Mapping[str, str]], records: bool = True
) -> None:
    """Start every command at once (one per "node"), wait for all, check all, prove all gone.
    ``records``: look for run records under ``cwd`` (not in the repository, which holds none)."""
    before = _records(cwd) if records else {}
    kept = _contents(cwd) if records else {}
    procs = [start(venv_named(c.text), cwd, e) for c, e in zip(commands, envs, strict=True)]
    deadline = time.monotonic() + COMMAND_TIMEOUT
    results = [finish(p, max(1.0, deadline - time.monotonic())) for p in procs]
    for p in procs:
        assert _session_gone(p.pid), f"{block.id}: processes left in the session of {p.args}"
    pids = _worker_pids(cwd, before) if records else []
    if pids:
        assert_gone(pids)
    for cmd, (code, out) in zip(commands, results, strict=True):
        check(cmd, code, out, block)
    if all(starts_no_run(c.text) for c in commands):
        changed = [str(p) for p, data in kept.items() if not p.exists() or p.read_bytes() != data]
        assert not changed, f"{block.id}: {commands[0].text!r} changed run records {changed}"


def run_srun_line(block: Block, cwd: Path, port: int) -> None:
    assert SBATCH.read_text().strip() == block.body.strip(), (
        "the sbatch block in multinode.md differs from docs/examples/multigpu.sbatch"
    )
    (srun,) = block.commands
    words = shlex.split(srun.text)
    start_at = words.index("multigpu")
    assert all(w.startswith("-") for w in words[1:start_at]), srun.text
    command = srun.text[srun.text.index(" multigpu ") + 1 :]
    job = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "ddp", "MASTER_PORT": str(port)}
    # One node: the SLURM layout is one machine's, a plain run.
    one = {
        **job,
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    run_together(block, [Command(command, srun.line, expects=["done: 1 rank(s)"])], cwd, [command_env(one)])
    # Two launcher tasks (two "nodes", both localhost): endpoint, node rank and run id from SLURM.
    two = {
        **job,
        "SLURM_JOB_NODELIST": "localhost,localhost",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "MASTER_PORT": str(free_port()),
    }
    nodes = [{**two, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURM_LOCALID": "0"} for i in (0, 1)]
    cmds = [
        Command(command, srun.line, expects=[f"node {i}: joined run slurm-4242 at localhost:"])
        for i in (0, 1)
    ]
    cmds[0].expects.append("[node 0 rank 0] done: 2 rank(s)")
    run_together(block, cmds, cwd, [command_env(e) for e in nodes])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", [tier(b) for b in BLOCKS])
def test_doc_block(block: Block, workdir: Path, busy_port: int) -> None:
    cwd = workdir
    port = free_port()
    env = command_env({"HOST": "127.0.0.1", "PORT": str(port), "BUSY_PORT": str(busy_port)})
    if block.kind == "gpu" and not gpu_visible():
        pytest.skip("needs a visible GPU")
    if block.kind == "setup":
        for cmd in block.commands:
            assert "pip install" in cmd.text, f"{block.id}: a setup block holds pip install lines only"
            dry = Command(cmd.text + DRY_RUN, cmd.line, cmd.exit_code, ["Would install multigpu"])
            run_together(block, [dry], ROOT, [env], records=False)
    elif block.kind == "venv":
        for cmd in block.commands:
            run_venv_chain(block, cmd, cwd, env)
    elif block.kind == "repo":
        for cmd in (c for c in block.commands if c.not_run is None and c.text not in CI_LINES):
            run_together(block, [cmd], ROOT, [env], records=False)
    elif block.kind == "sbatch":
        run_srun_line(block, cwd, port)
    elif block.kind == "nodes":
        assert len(block.commands) >= 2, f"{block.id}: a nodes block has one command per node"
        run_together(block, block.commands, cwd, [env] * len(block.commands))
    else:
        for cmd in (c for c in block.commands if c.not_run is None):
            run_together(block, [cmd], cwd, [env])


def test_conventions_hold() -> None:
    """The guide has blocks of every kind the conventions describe, and the pages the index lists."""
    kinds = {b.kind for b in BLOCKS}
    assert kinds == KINDS, kinds
    index = (DOCS / "README.md").read_text()
    for page in ("quickstart.md", "migrating.md", "multinode.md", "troubleshooting.md", *NOTEBOOK_PAGES):
        assert (DOCS / page).exists() and f"({page})" in index, page
    for block in (b for b in BLOCKS if b.kind == "nodes"):
        assert all("$HOST:$PORT" in c.text for c in block.commands), f"{block.id}: nodes meet at $HOST:$PORT"


NOTEBOOK_PAGES = ("notebooks.md",)


def python_cells(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), flags=re.S | re.M)


@pytest.mark.matrix  # a real kernel: the heavy tier after the suite (scripts/fault_matrix.sh)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_notebook_page_runs_in_a_kernel(page: str, tmp_path: Path) -> None:
    import psutil

    cells = python_cells(page)
    assert len(cells) >= 3, page
    kernel = Kernel(tmp_path, clean_env())
    started: set[int] = set()
    try:
        for number, cell in enumerate(cells, 1):
            text, reply = kernel.run(cell)
            started |= {p.pid for p in psutil.Process(kernel.pid).children(recursive=True)}
            assert reply["status"] == "ok", (
                f"{page} cell {number}: {reply.get('ename')}: {reply.get('evalue')}\n{text}"
            )
    finally:
        kernel.shutdown()
    assert_gone([*started, kernel.pid], timeout=10)
