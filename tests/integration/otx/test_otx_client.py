"""A real client, shaped like OTX 1.x's ``otx train``: its own CLI re-parsed by every rank, an
attribute-based hyper-parameter object, ``finalize`` on an ExitStack, and only rank 0 saving."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import PYTHON, assert_gone, clean_env, pids_in, write_script

pytestmark = [pytest.mark.slow, pytest.mark.integration]

OTX_TRAIN = """
    import argparse, json, os, sys
    from contextlib import ExitStack
    from datetime import datetime

    import torch
    from multigpu import MultiGPUManager, is_multigpu_child_process


    class ParameterGroup:
        # OTX's ConfigurableParameters: groups and parameters listed by name, next to UI metadata
        def __init__(self, header, parameters=None, groups=None):
            self.header, self.description, self.visible_in_ui = header, f"{header} settings", True
            for name, value in {**(parameters or {}), **(groups or {})}.items():
                setattr(self, name, value)
            self.parameters, self.groups = list(parameters or {}), list(groups or {})


    def get_args(argv=None):
        parser = argparse.ArgumentParser(prog="otx train")
        parser.add_argument("template")
        parser.add_argument("-o", "--output")
        parser.add_argument("--gpus")
        parser.add_argument("--rdzv-endpoint", default="localhost:0")
        parser.add_argument("--base-rank", type=int, default=0)
        parser.add_argument("--world-size", type=int, default=0)
        parser.add_argument("--enable-hpo", action="store_true")
        sub = parser.add_subparsers(dest="section")
        params = sub.add_parser("params")
        params.add_argument("--learning_parameters.learning_rate", dest="learning_rate", type=float)
        params.add_argument("--learning_parameters.batch_size", dest="batch_size", type=int)
        return parser.parse_args(argv)


    def hyper_parameters(args):
        learning = {"learning_rate": 0.01, "batch_size": 4}
        for name in learning:
            if getattr(args, name, None) is not None:
                learning[name] = getattr(args, name)
        return ParameterGroup("Root", groups={"learning_parameters": ParameterGroup("Learning", learning)})


    def train(exit_stack=None):
        args = get_args()
        hyper = hyper_parameters(args)
        if args.gpus:  # only the command the user typed has --gpus: the children's argv lost it
            manager = MultiGPUManager(train, args.gpus, args.rdzv_endpoint, args.base_rank, args.world_size,
                                      datetime.now(), device="cpu")
            if manager.is_available():
                if args.enable_hpo:  # HPO found better values; the children must train with them
                    hyper.learning_parameters.learning_rate = 0.05
                    hyper.learning_parameters.batch_size = 16
                args.output = manager.setup_multi_gpu_train(args.output, hyper if args.enable_hpo else None)
                exit_stack.callback(manager.finalize)
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_initialized() else 0
        print(f"pid={os.getpid()}", flush=True)
        lp = hyper.learning_parameters
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=lp.learning_rate)
        for step in range(5):
            x = torch.randn(lp.batch_size, 4) + rank
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            if step == 2 and rank == int(os.environ.get("FAIL_RANK", "-1")):
                raise RuntimeError(f"rank {rank}: the data loader lost its files")
            optimizer.step()
        print("RANK " + json.dumps({"rank": rank, "lr": lp.learning_rate, "batch_size": lp.batch_size,
                                    "output": args.output, "child": is_multigpu_child_process(),
                                    "weight": model.weight.sum().item()}) + "\\n", end="", flush=True)
        if not is_multigpu_child_process():
            torch.save(model.state_dict(), os.path.join(args.output, "weights.pth"))


    def main():
        with ExitStack() as exit_stack:
            return train(exit_stack)


    if __name__ == "__main__":
        sys.exit(main())
"""


def _otx_train(
    tmp_path: Path, extra_env: dict[str, str] | None = None, output: bool = True
) -> tuple[subprocess.CompletedProcess[str], str]:
    script = write_script(tmp_path, "otx_train_cli.py", OTX_TRAIN)
    out = ["--output", str(tmp_path / "otx-out")] if output else []
    argv = [
        PYTHON,
        str(script),
        "template.yaml",
        *out,
        "--gpus",
        "0,1,2",
        "--enable-hpo",
        "params",
        "--learning_parameters.batch_size",
        "8",
    ]
    proc = subprocess.run(
        argv, cwd=tmp_path, env=clean_env(extra_env), capture_output=True, text=True, timeout=120
    )
    text = proc.stdout + proc.stderr
    pids = set(pids_in(text))
    assert len(pids) == 3, text[-3000:]  # every rank printed its pid before training
    assert_gone(pids)
    return proc, text


def _ranks(text: str) -> dict[int, dict[str, object]]:
    found = [json.loads(m) for m in re.findall(r"RANK (\{.*\})$", text, re.M)]
    return {int(r["rank"]): r for r in found}


def test_otx_train_on_three_cpu_workers(tmp_path: Path) -> None:
    proc, text = _otx_train(tmp_path)
    assert proc.returncode == 0, text[-3000:]
    ranks = _ranks(text)
    assert sorted(ranks) == [0, 1, 2], text[-3000:]
    out = str(tmp_path / "otx-out")
    for rank, report in ranks.items():
        # the HPO values reached every rank's own argument parsing, after `params`
        assert report["lr"] == 0.05 and report["batch_size"] == 16, report
        assert report["output"] == out and report["child"] is (rank != 0)
    assert len({r["weight"] for r in ranks.values()}) == 1  # gradients were averaged: one model
    assert (tmp_path / "otx-out" / "weights.pth").is_file()  # saved once, by rank 0
    assert json.loads((tmp_path / "otx-out" / "optimized_hyper_parameters.json").read_text()) == {
        "learning_parameters.learning_rate": 0.05,
        "learning_parameters.batch_size": 16,
    }


@pytest.mark.matrix  # OTX's train on 3 ranks twice over: the heavy tier (the suite runs the healthy one)
def test_otx_train_with_a_failing_child(tmp_path: Path) -> None:
    proc, text = _otx_train(tmp_path, {"FAIL_RANK": "2"})
    assert proc.returncode == 1, text[-3000:]
    # rank 0's training loop got the typed error, with the child's own traceback, and the CLI ended
    expected = (
        r"^multigpu\.WorkerFailedError: rank 2 \(node 0, pid \d+\) exited with code 1: "
        r"RuntimeError: rank 2: the data loader lost its files$"
    )
    assert re.search(expected, proc.stderr, re.M), text[-3000:]
    assert 'raise RuntimeError(f"rank {rank}: the data loader lost its files")' in proc.stderr
    assert not (tmp_path / "otx-out" / "weights.pth").exists()
    assert 0 not in _ranks(text)
    assert os.path.exists(tmp_path / "otx-out" / "logs" / "attempt_0" / "rank_2.log")


def test_otx_train_without_an_output_path_leaves_no_temporary_folder(tmp_path: Path) -> None:
    # `otx train` without -o: setup_multi_gpu_train(None). The run goes where `multigpu run`'s would,
    # and nothing is left in the temporary folder (this test's own, so only what this run made counts).
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc, text = _otx_train(tmp_path, {"TMPDIR": str(tmp)}, output=False)
    assert proc.returncode == 0, text[-3000:]
    assert list(tmp.glob("multigpu-*")) == []  # torch may leave its own (torchinductor_<user>)
    runs = list((tmp_path / "multigpu_runs").iterdir())
    assert len(runs) == 1, runs
    ranks = _ranks(text)
    assert sorted(ranks) == [0, 1, 2], text[-3000:]
    assert {r["output"] for r in ranks.values()} == {str(runs[0])}  # every rank got the same path
    assert (runs[0] / "weights.pth").is_file() and (runs[0] / "logs" / "attempt_0" / "rank_1.log").is_file()
    assert not (runs[0] / ".multigpu").exists()  # the payload went at finalize()
