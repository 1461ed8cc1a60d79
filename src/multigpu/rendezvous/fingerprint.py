"""What each node of a multi-node job would run, compared once every node has joined and before any
rank starts. Runs in the launcher.

Nodes that run a different script, different arguments, a different torch (or CUDA build, or NCCL)
or multigpu, or a different device kind meet, then fail in their first collective (or hang) with an
error that names
neither difference. Each node publishes its fingerprint in the job's store as it joins; once all have
joined, every node reads all of them and reaches the same verdict on its own: a difference that
breaks a job refuses it on every node, in one line naming the nodes and the difference
(``--allow-mismatch`` makes that a warning); a soft one (a different Python patch release) is one
warning line. It costs a file hash and one store round trip: no torch import (the torch and NCCL
versions are read from the installed packages' metadata, the CUDA build from torch's ``version.py``).
A different ``--nproc-per-node`` is refused earlier, by the layout check of the join (``job.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from multigpu._version import __version__

BREAKING = {
    "multigpu": "multigpu",
    "python": "Python",
    "torch": "torch",
    "cuda": "torch's CUDA build",
    "nccl": "NCCL",
    "target": "the target",
    "sha256": "the target's contents",
    "args": "its arguments",
    "device": "the device kind",
}
SOFT = {"python_patch": "Python release"}


def target_sha256(target: str) -> str:
    """The script's SHA-256, or the module's source file's; '' where neither can be read."""
    path = Path(target)
    if not path.is_file():
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        path = Path(origin) if origin and origin not in ("built-in", "frozen") else Path()
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
"""The wheels torch's CUDA builds take NCCL from; a build with NCCL linked in has none ("none")."""
_CUDA = re.compile(r"""^cuda\s*(?::[^=\n]*)?=\s*['"]([^'"\n]+)['"]""", re.M)


def installed(*names: str) -> str:
    """The version of the first of ``names`` installed here, or "none"."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def torch_cuda() -> str:
    """The CUDA version torch was built for (``torch.version.cuda``), read from its ``version.py``
    without importing torch; "none" for a CPU build or where torch is not installed."""
    try:
        spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
        where = list(spec.submodule_search_locations or []) if spec is not None else []
        text = (Path(where[0]) / "version.py").read_text() if where else ""
    except (ImportError, ValueError, OSError):
        return "none"
    found = _CUDA.search(text)
    return found.group(1) if found else "none"


def fingerprint(target: str, args: tuple[str, ...], device: str) -> dict[str, str]:
    python = platform.python_version()
    return {
        "multigpu": __version__,
        "python": python.rsplit(".", 1)[0],
        "python_patch": python,
        "torch": installed("torch"),
        "cuda": torch_cuda(),
        "nccl": installed(*NCCL_PACKAGES),
        "target": Path(target).name,
        "sha256": target_sha256(target),
        "args": json.dumps(list(args)),
        "device": device,
        "machine": machine_id(),
    }


def machine_id() -> str:
    """Which machine this node runs on (this boot of it): never compared as a difference; it tells
    ``--preflight`` (``auto``) that every node shares one machine, whose processors they share too."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return platform.node()


def differences(prints: Mapping[int, Mapping[str, str]]) -> tuple[list[str], list[str]]:
    """(breaking, soft): one text per field the nodes disagree on, naming each node's value."""
    breaking: list[str] = []
    soft: list[str] = []
    for fields, out in ((BREAKING, breaking), (SOFT, soft)):
        for key, name in fields.items():
            values = {node: p.get(key, "?") for node, p in sorted(prints.items())}
            if len(set(values.values())) > 1:
                out.append(_contents_differ(prints, values) if key == "sha256" else _differs(name, values))
    return breaking, soft


def _differs(name: str, values: Mapping[int, str]) -> str:
    """``torch differs: node 0 2.5.1, node 1 2.6.0``."""
    return f"{name} differs: " + ", ".join(f"node {n} {v or '(unreadable)'}" for n, v in values.items())


def _contents_differ(prints: Mapping[int, Mapping[str, str]], hashes: Mapping[int, str]) -> str:
    """``train.py differs between nodes: node 0 SHA-256 1a2b3c4d5e6f, node 1 SHA-256 ...``: the file
    named, as the user would go and compare it (the targets' names, where those differ too)."""
    names = sorted({p.get("target", "?") for p in prints.values()})
    what = f"{names[0]} differs" if len(names) == 1 else "the targets (" + ", ".join(names) + ") differ"
    shown = (f"node {n} SHA-256 {v[:12]}" if v else f"node {n} (unreadable)" for n, v in hashes.items())
    return f"{what} between nodes: " + ", ".join(shown)
