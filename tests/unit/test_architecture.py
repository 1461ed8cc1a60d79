"""The package's architecture, checked: imports run one way, and each process's code stays in its room.

The layers, lowest first; a module may import its own subpackage and the layers below it, never one
above. ``contract`` is the vocabulary every process shares (standard library only); ``rank`` runs
inside a training process; the launcher's side (``supervisor`` up to ``cli``) sits above both. A circle
between modules, even through an import inside a function, fails too. The folder map
(docs/architecture.md) is checked against the tree. Sizes are checked too: no function or method over
50 lines, no module over 400, so a concern that grows gets its own function or module.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Mapping

from package_map import MODULES, PACKAGE, imports_of

ARCHITECTURE = PACKAGE.parent.parent / "docs" / "architecture.md"
LAYERS = (
    "contract",
    "rank",
    "config",
    "cluster",
    "console",
    "supervisor",
    "rendezvous",
    "preflight",
    "template",
    "record",
    "observe",
    "runner",
    "function",
    "otx",
    "cli",
)
"""Lowest first: the order docs/architecture.md lists them in."""

IN_A_RANK_OR_THE_TEMPLATE = (
    "multigpu.rank",
    "multigpu.preflight",
    "multigpu.template.child",
    "multigpu.template.server",
    "multigpu.template.__main__",
)
"""Code that runs inside a training process or the node's template process (or a process forked from
it, as the node's preflight check)."""
IN_THE_LAUNCHER = (
    "multigpu.console",
    "multigpu.supervisor",
    "multigpu.rendezvous.job",
    "multigpu.rendezvous.elastic",
    "multigpu.rendezvous.failure_sharing",
    "multigpu.rendezvous.latency",
    "multigpu.runner",
    "multigpu.record",
    "multigpu.observe",
    "multigpu.cluster",
    "multigpu.config",
    "multigpu.template.client",
    "multigpu.template.process",
    "multigpu.cli.entry",
    "multigpu.cli.main",
    "multigpu.cli.options",
    "multigpu.cli.torchrun",
    "multigpu.cli.layout",
    "multigpu.cli.preemption_flags",
    "multigpu.cli.run_args",
    "multigpu.cli.run_parser",
)
"""Code that runs only in the launcher (``multigpu run``; function mode's caller runs it too, and is a rank
as well). Shared by both sides, and so in neither list: ``contract``, the store (``rendezvous.store``),
the template's channel (``template.wire``)."""

MAX_FUNCTION_LINES = 50
MAX_MODULE_LINES = 400

Graph = Mapping[str, set[str]]


GRAPH: dict[str, set[str]] = {
    name: imports_of(path.read_text(), name, path.name == "__init__.py") for name, path in MODULES.items()
}


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(LAYERS)  # the facade and the command's entry sit on top
    if parts[1] == "_version":
        return -1
    return LAYERS.index(parts[1])


def upward(graph: Graph) -> list[str]:
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer(d) > layer(m) and m != "multigpu"
    )


def crossings(graph: Graph, sources: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith(sources)
        for d in deps
        if d.startswith(targets)
    )


def circle(graph: Graph) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_every_module_sits_in_a_layer() -> None:
    missing = [m for m in MODULES if len(m.split(".")) > 2 and m.split(".")[1] not in LAYERS]
    assert not missing, f"subpackages missing from LAYERS: {missing}"


def test_no_import_goes_up() -> None:
    assert not upward(GRAPH), "imports that go up a layer:\n" + "\n".join(upward(GRAPH))


def test_no_import_circle() -> None:
    found = circle(GRAPH)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_code_of_a_rank_or_the_template_imports_no_launcher_code() -> None:
    bad = crossings(GRAPH, IN_A_RANK_OR_THE_TEMPLATE, IN_THE_LAUNCHER)
    assert not bad, "\n".join(bad)


def test_launcher_code_imports_no_code_of_a_rank_or_the_template() -> None:
    bad = crossings(GRAPH, IN_THE_LAUNCHER, IN_A_RANK_OR_THE_TEMPLATE)
    assert not bad, "\n".join(bad)


def test_the_contract_uses_the_standard_library_only() -> None:
    allowed = set(sys.stdlib_module_names) | {"multigpu"}
    for name, path in MODULES.items():
        if not name.startswith("multigpu.contract"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad = [r for r in roots if r.split(".")[0] not in allowed]
            assert not bad, f"{name} imports {bad}"


def test_the_checks_find_what_they_look_for() -> None:
    """The checks above can fail: planted violations in a small graph are each found."""
    planted = imports_of(
        "from multigpu.cli.main import main\nimport multigpu.runner.attempts\n", "multigpu.contract.planted"
    )
    assert planted == {"multigpu.cli.main", "multigpu.runner.attempts"}
    graph = {
        "multigpu.contract.planted": planted,
        "multigpu.cli.main": set(),
        "multigpu.runner.attempts": {"multigpu.runner.attempt"},
        "multigpu.runner.attempt": {"multigpu.runner.attempts"},
        "multigpu.rank.bootstrap": {"multigpu.supervisor.loop"},
    }
    assert upward(graph) == [
        "multigpu.contract.planted -> multigpu.cli.main",
        "multigpu.contract.planted -> multigpu.runner.attempts",
        "multigpu.rank.bootstrap -> multigpu.supervisor.loop",
    ]
    assert circle(graph) == [
        "multigpu.runner.attempts",
        "multigpu.runner.attempt",
        "multigpu.runner.attempts",
    ]
    assert crossings(graph, IN_A_RANK_OR_THE_TEMPLATE, IN_THE_LAUNCHER) == [
        "multigpu.rank.bootstrap -> multigpu.supervisor.loop"
    ]


def oversized(source: str, where: str) -> list[str]:
    """The module (over ``MAX_MODULE_LINES``) and the functions and methods (over ``MAX_FUNCTION_LINES``,
    decorators not counted) in ``source`` that are too long, each as ``where[:line name] (N lines)``."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{where} ({lines} lines)")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_over_50_lines_and_no_module_over_400() -> None:
    found = [
        bad
        for path in sorted(MODULES.values())
        for bad in oversized(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, (
        f"over {MAX_FUNCTION_LINES} lines a function, {MAX_MODULE_LINES} a module; split them:\n"
        + "\n".join(found)
    )


def test_the_size_check_finds_a_long_function_and_a_long_module() -> None:
    """The size check can fail: a planted 51-line method and a 401-line module are found, a 50-line
    function is not."""
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    planted = "class C:\n    def long(self) -> None:\n" + body
    assert oversized(planted, "planted.py") == [f"planted.py:2 long ({MAX_FUNCTION_LINES + 1} lines)"]
    short = "def short() -> None:\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    assert oversized(short, "short.py") == []
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1), "big.py") == [
        f"big.py ({MAX_MODULE_LINES + 1} lines)"
    ]


def _folder_map() -> dict[str, str]:
    text = ARCHITECTURE.read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w/.]+)` \| (.+) \|$", text, re.M)}


def test_the_folder_map_names_every_folder_and_only_real_modules() -> None:
    rows = _folder_map()
    folders = sorted(
        str(init.parent.relative_to(PACKAGE))
        for init in PACKAGE.rglob("__init__.py")
        if init.parent != PACKAGE
    )
    named = sorted(key.rstrip("/") for key in rows if key.endswith("/"))
    assert named == folders, f"docs/architecture.md lists {named}; the package has {folders}"
    in_order = [k.rstrip("/") for k in rows if k.endswith("/") and k.count("/") == 1]
    assert in_order == list(LAYERS), "the map lists the layers lowest first"
    for key, text in rows.items():
        named_here = set(re.findall(r"`([\w]+)`", text))
        for module in named_here:
            if not (PACKAGE / key / f"{module}.py").exists():
                raise AssertionError(f"the folder map names {key}{module}, which does not exist")
        modules = {p.stem for p in (PACKAGE / key).glob("*.py")} - {"__init__", "__main__"}
        assert modules <= named_here, f"the folder map leaves out {key}{sorted(modules - named_here)}"


def test_every_subpackage_says_where_it_runs() -> None:
    for init in sorted(PACKAGE.glob("**/__init__.py")):
        if init.parent == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80 and re.search(r"\bruns? (in|inside)\b", doc, re.I), (
            f"{init.parent.name}/__init__.py says in a paragraph which process it runs in"
        )
