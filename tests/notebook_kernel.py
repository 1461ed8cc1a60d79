"""A real Jupyter kernel for tests: ``jupyter_client`` starts ipykernel, cells run as a notebook runs them.

The kernel runs the test's Python (``sys.executable``) with the test's environment, in a folder the test
names; ``run`` executes one cell and returns its text output and the reply; ``start``/``finish`` let a
test interrupt a running cell.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jupyter_client.manager import KernelManager
from jupyter_core.utils import ensure_event_loop


class Kernel:
    def __init__(self, cwd: Path, env: Mapping[str, str]) -> None:
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd), env=dict(env))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self.pid = int(self.manager.provisioner.process.pid)  # type: ignore[union-attr]

    def start(self, code: str) -> str:
        """Send a cell; its id."""
        return str(self.client.execute(code))

    def output_until(self, msg_id: str, text: str, timeout: float) -> str:
        """The cell's output so far, read until it contains ``text``."""
        deadline, seen = time.monotonic() + timeout, ""
        while text not in seen:
            seen += self._next_output(msg_id, deadline)
        return seen

    def finish(self, msg_id: str, timeout: float) -> tuple[str, dict[str, Any]]:
        """The rest of the cell's output and its reply's content, once the kernel is idle again."""
        deadline, seen = time.monotonic() + timeout, ""
        while True:
            try:
                chunk = self._next_output(msg_id, deadline, stop_at_idle=True)
            except StopIteration:
                break
            seen += chunk
        reply = self.client.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
        return seen, dict(reply["content"])

    def run(self, code: str, timeout: float = 180) -> tuple[str, dict[str, Any]]:
        return self.finish(self.start(code), timeout)

    def _next_output(self, msg_id: str, deadline: float, stop_at_idle: bool = False) -> str:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the kernel's cell {msg_id} did not get there in time")
            try:
                msg = self.client.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                return str(content["text"])
            if kind in ("execute_result", "display_data"):
                return str(content["data"].get("text/plain", "")) + "\n"
            if kind == "error":
                return f"{content['ename']}: {content['evalue']}\n"
            if (
                stop_at_idle
                and kind == "status"
                and content["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id
            ):
                raise StopIteration

    def shutdown(self) -> None:
        """Kill the kernel (as a notebook's shutdown does when it does not answer) and close every socket."""
        if self.manager.has_kernel:
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=True)
        self.manager.cleanup_resources()
        self.client.context.destroy(linger=0)
        self.manager.context.destroy(linger=0)
        ensure_event_loop().close()  # jupyter_client's synchronous calls ran on it: its self-pipe goes
