"""Every module of the package is imported by a test, or this file says why not.

A test imports a module by ``import multigpu.x.y``, ``from multigpu.x.y import ...`` or
``from multigpu.x import y``, in its own code or in a Python script it writes for a child process
(``textwrap.dedent``-ed string literals are read too). A module no test imports is tested, if at all,
through other modules or end to end: ``NOT_IMPORTED`` names each one with the reason beside it. A
module added without a test, or one a test stopped importing, fails here until it gets a test or a
line; an entry whose module a test now imports, or that no longer exists, or that names a test file
that does not exist, fails too, so the list only shrinks by being kept true. Subpackage ``__init__``
files hold only their docstring and are left out.

The other way round, a test file follows its module: ``unit/<folder>/test_<x>.py`` tests
``multigpu/<folder>/<x>.py`` (nested folders too), or ``OTHER_NAMES`` says which module(s) it tests
and why its name is not theirs.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
import textwrap
from pathlib import Path

from package_map import MODULES, PACKAGE, imports_of

TESTS = Path(__file__).resolve().parents[1]
UNIT = TESTS / "unit"

NOT_IMPORTED = {
    "multigpu.__main__": "`python -m multigpu`: helpers.MULTIGPU, in every integration test",
    "multigpu._version": "one constant: multigpu.__version__, and pyproject's dynamic version",
    "multigpu.supervisor.hangs.beat_pipe": "the ranks' beats, read by the loop: unit/supervisor/test_loop.py",
    "multigpu.supervisor.hangs.stragglers": "through its ProgressBook: unit/supervisor/hangs/test_book.py",
    "multigpu.cli.demo": "`multigpu demo` in integration/cli/test_run_cli.py",
    "multigpu.cli.layout": "through cli.run_args.parse_run_args in unit/cli/test_layout.py",
    "multigpu.cli.preemption_flags": "through cli.run_args.parse_run_args in unit/cluster/test_requeue.py",
    "multigpu.cli.torchrun": "through cli.run_args.parse_run_args in unit/cli/test_torchrun.py",
    "multigpu.otx.watcher": "the caller's watch over its children in integration/function/",
    "multigpu.preflight.__main__": "`python -m multigpu.preflight`: unit/preflight/test_check.py",
    "multigpu.rank.__main__": "`python -m multigpu.rank`: every fresh rank (unit/supervisor/test_loop.py)",
    "multigpu.rank.dump_signal": "stacks on a hang: unit/supervisor/test_loop.py, integration/faults/",
    "multigpu.rank.exiting": "how a failed rank leaves: integration/faults/test_worker_exit.py",
    "multigpu.rank.guard": "a launcher's SIGKILL ends its ranks: integration/faults/test_faults.py",
    "multigpu.rank.program": "`--no-python` in integration/cli/test_no_python.py",
    "multigpu.rank.sentinel": "its own process, started in integration/faults/test_sentinel.py",
    "multigpu.supervisor.run_updates": "inside every Supervisor: unit/supervisor/test_loop.py",
    "multigpu.supervisor.hangs.stack_dumps": "the hang tests of unit/supervisor/test_loop.py",
    "multigpu.supervisor.teardown": "Supervisor.close(): the SIGKILL tests of unit/supervisor/test_loop.py",
    "multigpu.template.__main__": "`python -m multigpu.template`: integration/test_template.py",
}
"""Module -> why no test imports it (one line: which test exercises it, and how)."""

OTHER_NAMES: dict[str, tuple[tuple[str, ...], str]] = {
    "record/test_run_json_launcher_lost.py": (
        ("multigpu.record.run_json",),
        "a record closed as `launcher lost` (issue 31), from fake /proc readings, apart from its writing",
    ),
}
"""Test file under ``unit/`` whose name mirrors no module -> (the modules it tests, why; one line)."""


def imported_by(source: str) -> set[str]:
    """The package's modules ``source`` imports, and those its string literals import as Python."""
    found = imports_of(source, "tests")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "import" in node.value
            and "multigpu" in node.value
        ):
            with contextlib.suppress(SyntaxError):
                found |= imported_by(textwrap.dedent(node.value))
    return found


def has_code(path: Path) -> bool:
    """More than a docstring (and ``from __future__``): a subpackage's ``__init__`` has nothing to test."""
    body = ast.parse(path.read_text()).body
    return any(
        not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        for n in body
    )


@functools.cache
def imported_by_the_tests() -> frozenset[str]:
    found: set[str] = set()
    for path in sorted(TESTS.rglob("*.py")):
        if path.resolve() != Path(__file__).resolve():
            found |= imported_by(path.read_text())
    return frozenset(found)


def test_every_module_is_imported_by_a_test_or_says_why_not() -> None:
    imported = imported_by_the_tests()
    missing = sorted(m for m, p in MODULES.items() if has_code(p) and m not in imported | NOT_IMPORTED.keys())
    assert not missing, (
        "no test imports these modules; add a unit test, or a line to NOT_IMPORTED "
        "naming the test that exercises it:\n" + "\n".join(missing)
    )


def test_every_entry_of_the_list_is_still_true() -> None:
    imported = imported_by_the_tests()
    stale = sorted(m for m in NOT_IMPORTED if m in imported or m not in MODULES)
    assert not stale, f"a test imports these now, or they are gone; remove them from NOT_IMPORTED: {stale}"
    assert all(why.strip() and "\n" not in why for why in NOT_IMPORTED.values())
    named = {
        path for why in NOT_IMPORTED.values() for path in re.findall(r"\b(?:unit|integration)/[\w/.]*", why)
    }
    gone = sorted(path for path in named if not (TESTS / path).exists())
    assert not gone, f"NOT_IMPORTED names tests that do not exist: {gone}"


def test_imports_are_found_in_code_and_in_a_childs_script() -> None:
    source = textwrap.dedent('''
        import multigpu.rank.guard
        from multigpu.cluster import devices
        from multigpu.supervisor.loop import Supervisor
        SCRIPT = """
            from multigpu.template.wire import send
        """
        NOT_PYTHON = "multigpu run --cpu 2 train.py"
    ''')
    assert imported_by(source) == {
        "multigpu.rank.guard",
        "multigpu.cluster.devices",
        "multigpu.supervisor.loop",
        "multigpu.template.wire",
    }
    assert not has_code(MODULES["multigpu.cli"]) and has_code(MODULES["multigpu"])


def unmirrored(unit: Path, package: Path) -> list[str]:
    """The test files under ``unit``'s folders (``<folder>/test_<x>.py``, nested folders too) with no
    module ``<folder>/<x>.py`` in ``package``; the files directly in ``unit`` test the package whole."""
    found = []
    for path in sorted(unit.rglob("test_*.py")):
        rel = path.relative_to(unit)
        if (
            len(rel.parts) > 1
            and not (package / rel.parent / f"{path.stem.removeprefix('test_')}.py").exists()
        ):
            found.append(rel.as_posix())
    return found


def test_every_unit_test_file_mirrors_its_module_or_says_what_it_tests() -> None:
    unexplained = [name for name in unmirrored(UNIT, PACKAGE) if name not in OTHER_NAMES]
    assert not unexplained, (
        "these test files name no module in the same folder of src/multigpu/: rename them for the "
        "module they test (git mv), or add them to OTHER_NAMES with the modules and why:\n"
        + "\n".join(unexplained)
    )


def test_every_other_name_is_still_true() -> None:
    strays = set(unmirrored(UNIT, PACKAGE))
    stale = sorted(name for name in OTHER_NAMES if name not in strays)
    assert not stale, f"gone, or now named for a module; remove them from OTHER_NAMES: {stale}"
    for name, (modules, why) in OTHER_NAMES.items():
        assert modules and all(m in MODULES for m in modules), f"{name}: {modules} are not all modules"
        assert modules[0] in imported_by((UNIT / name).read_text()), f"{name} does not import {modules[0]}"
        assert why.strip() and "\n" not in why, name


def test_a_planted_stray_test_name_is_caught(tmp_path: Path) -> None:
    unit, package = tmp_path / "unit", tmp_path / "multigpu"
    for made in (
        unit / "cli" / "test_main.py",
        unit / "cli" / "test_planted.py",
        unit / "supervisor" / "hangs" / "test_book.py",
        unit / "supervisor" / "hangs" / "test_planted.py",
        unit / "cli" / "conftest.py",
        unit / "test_architecture.py",
        package / "cli" / "main.py",
        package / "supervisor" / "hangs" / "book.py",
    ):
        made.parent.mkdir(parents=True, exist_ok=True)
        made.touch()
    assert unmirrored(unit, package) == ["cli/test_planted.py", "supervisor/hangs/test_planted.py"]
