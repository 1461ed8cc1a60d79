"""The elastic job's round loop: rendezvous, run the round, decide what the next round is.

torchrun's agent semantics: a node waiting to join ends the round on every node without counting as a
restart; any other failed round (a rank failed, a node was lost) counts once, job-wide, and every node
of the round goes to the next round together while ``--max-restarts`` allows, else every node ends with
the same root cause. Imported by the launcher only in multi-node mode (it imports torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from multigpu.config.run import RunConfig, new_run_id
from multigpu.contract.errors import MEMBERSHIP_CHANGE, STORE_LOST, RendezvousError
from multigpu.contract.prctl import set_child_subreaper
from multigpu.launch.attempt import exit_code, run_attempt
from multigpu.launch.record import RunRecord
from multigpu.launch.report import format_report
from multigpu.launch.rundir import check_run_id
from multigpu.launch.specs import AttemptContext, build_specs
from multigpu.rendezvous.elastic import (
    ElasticRendezvous,
    Round,
    node_id,
    open_store,
    settings_from,
    settle_run_id,
)
from multigpu.rendezvous.fate import serve_until_all_done
from multigpu.supervisor.console import say
from multigpu.supervisor.spawning import Spawner
from multigpu.supervisor.states import RunResult, RunStatus
from multigpu.template.client import spawner_for


def launch_elastic(config: RunConfig, base_env: Mapping[str, str], cvd: str | None,
                   devices: list[str]) -> tuple[int, RunRecord]:
    """Run an elastic job on this node to its end: the launcher's exit code and the run record."""
    assert config.rdzv.endpoint is not None
    settings = settings_from(config.rdzv.conf)
    store, hosted = open_store(config.rdzv.endpoint, settings)
    run_id = settle_run_id(store, config.output.run_id, new_run_id())
    check_run_id(run_id, "the run id agreed at rendezvous")
    rdzv = ElasticRendezvous(config, store, run_id, settings, hosted=hosted)
    output_dir = (config.output.dir or Path("multigpu_runs") / run_id).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    record = RunRecord.create(output_dir / f"run_{node_id()}.json", config, run_id, devices)
    role = "serves" if hosted else "joins"
    say(f"run {run_id}: elastic job of {config.rdzv.min_nodes}:{config.rdzv.max_nodes} node(s), "
        f"{config.nproc} worker(s) here; this launcher {role} the rendezvous at {config.rdzv.endpoint}; "
        f"output in {output_dir}")
    code, over = 1, False
    spawner = spawner_for(config, None, say, base_env)  # every round's ranks fork from one template
    try:
        spawner.wait_ready()  # before the first round: a node still importing torch would look lost
        code, over = run_rounds(config, rdzv, record, output_dir, base_env, cvd, spawner)
    except RendezvousError:
        record.finish("failed", 1)
        over = True
        raise
    except KeyboardInterrupt:  # a Ctrl-C outside a round's ranks (waiting for a round): it says so
        record.finish("interrupted", 130)
        raise
    finally:
        spawner.close()
        rdzv.shutdown(close=over)
    return code, record


def _round_config(config: RunConfig, rnd: Round, run_id: str) -> RunConfig:
    return dataclasses.replace(config, base_rank=rnd.base_rank, world_size=rnd.world_size,
                               node_rank=rnd.group_rank, nnodes=rnd.group_world_size,
                               output=dataclasses.replace(config.output, run_id=run_id))


def run_rounds(config: RunConfig, rdzv: ElasticRendezvous, record: RunRecord, output_dir: Path,
               base_env: Mapping[str, str], cvd: str | None,
               spawner: Spawner | None = None) -> tuple[int, bool]:
    """(exit code, whether the job is over for every node: then the rendezvous is closed)."""
    reaper = set_child_subreaper()
    while True:
        rnd = rdzv.next_round()
        last = rnd.base_rank + config.nproc - 1
        say(f"node {rnd.group_rank} of {rnd.group_world_size}: ranks {rnd.base_rank}..{last} of "
            f"{rnd.world_size}, restart count {rnd.restart_count}")
        round_config = _round_config(config, rnd, rdzv.run_id)
        context = AttemptContext(rdzv.run_id, output_dir, rnd.restart_count, rnd.master_addr,
                                 rnd.master_port, cvd)
        specs = build_specs(round_config, context, base_env)
        for spec in specs:  # rounds of one restart count share a log folder: no error of an earlier round
            if spec.error_file is not None:
                spec.error_file.unlink(missing_ok=True)
        record.begin_attempt(rnd.restart_count, rnd.master_addr, rnd.master_port)
        result, workers = run_attempt(round_config, specs, record, reaper, rnd.restart_count, rnd.job,
                                       spawner=spawner)
        record.end_attempt(result)
        rdzv.handler.worker_store = None  # the round's workers are gone: so is their store
        code = exit_code(result)
        if result.status is RunStatus.SUCCEEDED:
            if rdzv.hosted:  # the store's host serves until every node is done (or the job died)
                serve_until_all_done(rnd.job)
            return _finish(record, 0, over=True)
        if result.status is RunStatus.INTERRUPTED:
            return _finish(record, code, over=False)
        root = result.root_cause
        if root is not None and root.error_type == MEMBERSHIP_CHANGE:
            say(f"{root.message}; stopping this round on every node")
            continue
        say(format_report(result, workers, attempt=rnd.restart_count))
        if not _restart(config, rdzv, rnd, result):
            return _finish(record, code, over=True)


def _restart(config: RunConfig, rdzv: ElasticRendezvous, rnd: Round, result: RunResult) -> bool:
    """Whether every node of the round goes on to the next one (the same answer on every node)."""
    kinds = {f.error_type for f in result.failures}
    if STORE_LOST in kinds:
        return False  # no rendezvous is possible without the store
    if rnd.restart_count >= config.supervision.max_restarts:
        return False
    count = rdzv.count_restart(rnd.restart_count)
    say(f"restarting every node: restart {count} of {config.supervision.max_restarts}, through a new "
        "rendezvous round")
    return True


def _finish(record: RunRecord, code: int, *, over: bool) -> tuple[int, bool]:
    record.finish("succeeded" if code == 0 else "failed", code)
    return code, over
