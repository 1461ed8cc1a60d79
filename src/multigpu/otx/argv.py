"""Edit command lines the way OTX's CLI expects: ``[options] params [hyper-parameters]``."""

from __future__ import annotations

import enum
import re
import sys
from collections.abc import Mapping
from typing import Any

PARAMS = "params"
_NUMBER = re.compile(r"^-?\d+(\.\d*)?([eE][-+]?\d+)?$")


def _is_option(token: str) -> bool:
    return token.startswith("-") and not _NUMBER.match(token)


def _find_key(argv: list[str], keys: list[str]) -> tuple[int, str, bool] | None:
    """Index of the first token naming one of ``keys``, which key, and whether it is ``--key=value``."""
    for i, token in enumerate(argv):
        for key in keys:
            if token == key:
                return i, key, False
            if token.startswith(key + "="):
                return i, key, True
    return None


def set_arguments_to_argv(
    keys: str | list[str], value: str | None = None, after_params: bool = False
) -> None:
    """Set ``keys[0] value`` in ``sys.argv``: replace an existing value, or insert it where OTX parses it.

    Without ``after_params`` a new key goes just before the ``params`` sub-command (or at the end);
    with it, after ``params`` (added when missing).
    """
    key_list = [keys] if isinstance(keys, str) else list(keys)
    if not key_list:
        raise ValueError("set_arguments_to_argv needs at least one key")
    argv = sys.argv
    found = _find_key(argv, key_list)
    if found is not None:
        if value is not None:
            _replace_value(argv, *found, value)
        return
    new = [key_list[0]] if value is None else [key_list[0], value]
    if after_params:
        if PARAMS not in argv:
            argv.append(PARAMS)
        argv.extend(new)
    elif PARAMS in argv:
        at = argv.index(PARAMS)
        argv[at:at] = new
    else:
        argv.extend(new)


def _replace_value(argv: list[str], index: int, key: str, inline: bool, value: str) -> None:
    if inline:
        argv[index] = f"{key}={value}"
        return
    nxt = index + 1
    if nxt >= len(argv) or argv[nxt] == PARAMS or _is_option(argv[nxt]):
        argv.insert(nxt, value)
    else:
        argv[nxt] = value


def remove_option(argv: list[str], key: str, *, takes_value: bool = True) -> list[str]:
    """A copy of ``argv`` without ``key`` in any form (``--key v``, ``--key=v``, bare ``--key``)."""
    out: list[str] = []
    skip = False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        if token == key:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            skip = takes_value and nxt is not None and nxt != PARAMS and not _is_option(nxt)
            continue
        if token.startswith(key + "="):
            continue
        out.append(token)
    return out


_LEAF = (str, int, float, bool, enum.Enum, type(None))


def flatten_parameters(params: Any) -> dict[str, Any]:
    """Hyper-parameters as ``{"group.sub.name": value}``, from a mapping or an OTX-style object.

    OTX passes its ``ConfigurableParameters``: nested attribute groups that list their own
    ``groups`` and ``parameters`` by name, next to metadata (``header``, ``description``, ...) that
    must not reach the command line. Those lists are followed when present; any other object gives its
    public instance attributes. Mapping keys may already be dotted names.
    """
    out: dict[str, Any] = {}
    _flatten(params, "", out, depth=0)
    return out


def _flatten(node: Any, prefix: str, out: dict[str, Any], depth: int) -> None:
    if depth > 16:
        raise ValueError(f"hyper-parameters nested too deeply at {prefix!r}")
    for name, value in _children(node):
        key = f"{prefix}{name}"
        if isinstance(value, _LEAF):
            out[key] = value.value if isinstance(value, enum.Enum) else value
        elif isinstance(value, Mapping) or _is_group(value):
            _flatten(value, key + ".", out, depth + 1)
        else:
            raise ValueError(
                f"hyper-parameter {key!r} is a {type(value).__name__}, not a number, string, boolean or group"
            )


def _is_group(value: Any) -> bool:
    return hasattr(value, "__dict__") and not callable(value)


def _children(node: Any) -> list[tuple[str, Any]]:
    if isinstance(node, Mapping):
        return [(str(k), v) for k, v in node.items()]
    groups, parameters = getattr(node, "groups", None), getattr(node, "parameters", None)
    if isinstance(groups, list) and isinstance(parameters, list):  # OTX's ParameterGroup
        return [(name, getattr(node, name)) for name in [*parameters, *groups]]
    if not _is_group(node):
        raise ValueError(
            f"hyper-parameters must be a mapping or an object with attributes, got {type(node).__name__}"
        )
    return [(k, v) for k, v in vars(node).items() if not k.startswith("_") and not callable(v)]
