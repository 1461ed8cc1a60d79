"""``--preempt-signal``, ``--preempt-grace`` and ``--requeue``/``--no-requeue``: parsed into the config.

Launcher side, at parse time; what the options then do is ``cluster/requeue.py``'s and
``runner/preempt_watch.py``'s.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping

from multigpu.cli.options import RunOptions
from multigpu.cluster.requeue import SLURM_DEFAULT, WARNING_SIGNALS, under_slurm
from multigpu.config.run import PreemptionConfig, RunConfig
from multigpu.contract.errors import UsageError
from multigpu.contract.values import seconds, signal_names, signal_numbers


def _signal_names(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("none", "off", "0"):
        return ()
    numbers = signal_numbers(text, "--preempt-signal")
    bad = [n for n in numbers if n not in WARNING_SIGNALS]
    if bad or not numbers:
        what = signal.Signals(bad[0]).name if bad else repr(text)
        raise UsageError(
            f"--preempt-signal: {what} cannot be a warning (INT, TERM and QUIT stop the run); "
            "use USR1, USR2 or HUP, or none"
        )
    return signal_names(numbers)


def apply_preemption_options(config: RunConfig, values: RunOptions, env: Mapping[str, str]) -> RunConfig:
    """``--preempt-signal``, ``--preempt-grace``, ``--requeue``/``--no-requeue`` into the config."""
    slurm = under_slurm(env)
    given = values.preempt_signal
    signals = _signal_names(given) if given else (SLURM_DEFAULT if slurm else ())
    on = values.requeue is True
    off = values.no_requeue is True or values.requeue is False  # MULTIGPU_REQUEUE=0
    if on and off:
        raise UsageError("--requeue and --no-requeue contradict each other; give one")
    if on and not slurm:
        raise UsageError("--requeue needs a SLURM batch job (SLURM_JOB_ID is not set)")
    if on and not signals:
        raise UsageError(
            "--requeue needs a warning signal: --preempt-signal USR1 (and #SBATCH --signal=USR1@90)"
        )
    grace = values.preempt_grace
    if grace and not signals:
        raise UsageError("--preempt-grace needs a warning signal (--preempt-signal)")
    requeue = on or (slurm and bool(signals) and not off)
    # A requeued job (by us, or by SLURM itself after a preemption or a node failure) keeps its job id:
    # the next allocation finds this one's folder by the run id (srun steps have it already).
    run_id = config.output.run_id or (f"slurm-{env['SLURM_JOB_ID']}" if slurm else None)
    grace_s = seconds(grace, "--preempt-grace", positive=True) if grace else None
    return dataclasses.replace(
        config,
        preemption=PreemptionConfig(signals, requeue, grace_s),
        output=dataclasses.replace(config.output, run_id=run_id),
    )
