"""The package's modules, and the ``multigpu`` modules a source imports, read with ``ast``.

Shared by the architecture check (``unit/test_architecture.py``: imports run one way) and the map of
what the tests import (``unit/test_coverage_map.py``), so both read an import the same way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import multigpu

PACKAGE = Path(multigpu.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every ``multigpu`` module ``source`` imports, wherever the import statement stands."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("multigpu"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "multigpu":
                continue
            for alias in node.names:  # ``from multigpu.x import y``: y may be a module itself
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    found.discard(name)
    return found
