"""Edit command lines the way OTX's CLI expects: ``[options] params [hyper-parameters]``."""

from __future__ import annotations

import re
import sys

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
