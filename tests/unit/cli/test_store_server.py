"""``multigpu store``'s usage mistakes, before it binds anything: a store the nodes must find needs
the fixed port they name, so its refusal never suggests port 0 (``parse_endpoint``'s hint elsewhere).
The store itself runs for real in ``integration/multinode/test_store_command.py``."""

from __future__ import annotations

import pytest

from multigpu.cli.store_server import cmd_store
from multigpu.contract.errors import UsageError


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "[::1]", " 10.0.0.5 "])
def test_an_address_without_a_port_asks_for_the_fixed_port_the_jobs_name(address: str) -> None:
    with pytest.raises(UsageError) as info:
        cmd_store([address])
    text = str(info.value)
    assert text.startswith(f"multigpu store {address!r} has no port: write HOST:PORT"), text
    assert "the fixed port the jobs name in --rdzv-endpoint" in text and "port 0" not in text, text


def test_port_zero_is_refused_as_before() -> None:
    with pytest.raises(UsageError, match="needs a fixed port"):
        cmd_store(["127.0.0.1:0"])
