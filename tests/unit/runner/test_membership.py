"""What a launcher says about ``--debug-server`` as it opens: the page's address with the run's token
where rank 0 runs here, and one warning when the server listens beyond loopback."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import free_port
from multigpu.cli.run_args import parse_run_args
from multigpu.contract.names import DEBUG_SERVER_ENV
from multigpu.runner.membership import debug_server_lines


def test_the_page_address_carries_the_token_and_only_loopback_goes_without_a_warning(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    port = free_port()
    config, _ = parse_run_args(["--cpu", "1", "--debug-server", str(port), str(script)], {})
    token = json.loads(config.extra_env[DEBUG_SERVER_ENV])[2]
    address = f"http://127.0.0.1:{port}/?token={token}"
    here = debug_server_lines(config, rank0_here=True)
    assert here == [f"debug server (torch's, rank 0's node): {address}"]
    assert debug_server_lines(config, rank0_here=None) == [
        f"debug server (torch's): {address} if rank 0 runs on this node"
    ]
    assert debug_server_lines(config, rank0_here=False) == []
    wide, _ = parse_run_args(["--cpu", "1", "--debug-server", f"0.0.0.0:{free_port()}", str(script)], {})
    lines = debug_server_lines(wide, rank0_here=True)
    assert len(lines) == 2 and lines[1] == (
        "warning: the debug server listens on 0.0.0.0, not loopback: every host that reaches it can try, "
        "and its token crosses the network unencrypted (HTTP)"
    )
    plain, _ = parse_run_args(["--cpu", "1", str(script)], {})
    assert debug_server_lines(plain, rank0_here=True) == []
