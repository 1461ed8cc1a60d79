"""Preemption on SLURM, the launcher's side: which signals warn, requeueing the job, and resuming it.

* Settings. ``--preempt-signal`` names the warning signals (USR1, USR2 or HUP: the launcher passes
  them on to the ranks; INT/TERM/QUIT stop the run). Under SLURM (``SLURM_JOB_ID`` set) the default is
  USR1 and USR2 (``#SBATCH --signal=USR1@90``; submitit uses USR2), elsewhere none. ``--requeue`` is
  on by default under SLURM when a warning signal is set.
* Requeue. Once the ranks have saved and exited after a warning, node 0's launcher runs
  ``scontrol requeue <job>`` (``<array job>_<task>`` for an array task) as its very last act: SLURM
  ends this allocation when it takes the request. The launcher exits with ``EXIT_PREEMPTED``.
* Resume. In the next allocation SLURM sets ``SLURM_RESTART_COUNT``; the run keeps its run id
  (``slurm-<job id>``), and allocation k writes into ``<job folder>/requeue_<k>`` so that nothing of the
  earlier allocations is replaced. The ranks get ``MULTIGPU_RESUMED=k`` and
  ``MULTIGPU_PREVIOUS_OUTPUT``, the folder of the latest earlier allocation.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from .config import RunConfig
from .environment import PREEMPTION_KEYS
from .errors import UsageError
from .preemption import SIGNALS_ENV, parse_signals
from .torchrun_args import seconds_option

WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SLURM_DEFAULT = ("SIGUSR1", "SIGUSR2")
RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"
RESUMED_ENV = "MULTIGPU_RESUMED"
PREVIOUS_OUTPUT_ENV = "MULTIGPU_PREVIOUS_OUTPUT"
SCONTROL_TIMEOUT_S = 60.0


def under_slurm(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def _signal_names(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("none", "off", "0"):
        return ()
    try:
        numbers = parse_signals(text)
    except ValueError as exc:
        raise UsageError(f"--preempt-signal: {exc}") from None
    bad = [n for n in numbers if n not in WARNING_SIGNALS]
    if bad or not numbers:
        what = signal.Signals(bad[0]).name if bad else repr(text)
        raise UsageError(f"--preempt-signal: {what} cannot be a warning (INT, TERM and QUIT stop the run); "
                         "use USR1, USR2 or HUP, or none")
    return tuple(dict.fromkeys(signal.Signals(n).name for n in numbers))


def apply_preemption_options(config: RunConfig, values: Mapping[str, str | None],
                             env: Mapping[str, str]) -> RunConfig:
    """``--preempt-signal``, ``--preempt-grace``, ``--requeue``/``--no-requeue`` into the config."""
    slurm = under_slurm(env)
    given = values.get("preempt_signal")
    signals = _signal_names(given) if given else (SLURM_DEFAULT if slurm else ())
    on = values.get("requeue") == "1"
    off = values.get("no_requeue") == "1" or values.get("requeue") == "0"  # MULTIGPU_REQUEUE=0
    if on and off:
        raise UsageError("--requeue and --no-requeue contradict each other; give one")
    if on and not slurm:
        raise UsageError("--requeue needs a SLURM batch job (SLURM_JOB_ID is not set)")
    if on and not signals:
        raise UsageError("--requeue needs a warning signal: --preempt-signal USR1 (and #SBATCH "
                         "--signal=USR1@90)")
    grace = values.get("preempt_grace")
    if grace and not signals:
        raise UsageError("--preempt-grace needs a warning signal (--preempt-signal)")
    requeue = on or (slurm and bool(signals) and not off)
    # A requeued job (by us, or by SLURM itself after a preemption or a node failure) keeps its job id:
    # the next allocation finds this one's folder by the run id (srun steps have it already).
    run_id = config.run_id or (f"slurm-{env['SLURM_JOB_ID']}" if slurm else None)
    return dataclasses.replace(config, preempt_signals=signals, requeue=requeue, run_id=run_id,
                               preempt_grace=seconds_option(grace, "--preempt-grace") if grace else None)


def resume_count(env: Mapping[str, str]) -> int:
    """How many allocations of this job came before this one (SLURM counts requeues and restarts)."""
    raw = env.get(RESTART_COUNT_ENV, "")
    return int(raw) if raw.isdigit() else 0


def allocation_dir(job_dir: Path, env: Mapping[str, str]) -> Path:
    """This allocation's output folder: the job's folder for the first, a subfolder for each later one."""
    count = resume_count(env)
    return job_dir if count == 0 else job_dir / f"requeue_{count}"


def previous_output(output_dir: Path, count: int) -> Path | None:
    """The folder of the latest earlier allocation that left one (an allocation may have died unseen)."""
    if count == 0:
        return None
    job_dir = output_dir.parent
    for k in range(count - 1, 0, -1):
        if (job_dir / f"requeue_{k}").is_dir():
            return job_dir / f"requeue_{k}"
    return job_dir


def rank_env(config: RunConfig, output_dir: Path, base_env: Mapping[str, str]) -> dict[str, str]:
    """``base_env`` with what the ranks need: the warning signals, the resume count, the previous folder."""
    env = {k: v for k, v in base_env.items() if k not in PREEMPTION_KEYS}
    if config.preempt_signals:
        env[SIGNALS_ENV] = ",".join(config.preempt_signals)
    count = resume_count(base_env)
    env[RESUMED_ENV] = str(count)
    previous = previous_output(output_dir, count)
    if previous is not None:
        env[PREVIOUS_OUTPUT_ENV] = str(previous)
    return env


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for an array task, else the job id."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def requeue_job(env: Mapping[str, str], run: Runner = subprocess.run) -> tuple[str, str | None]:
    """Run ``scontrol requeue``: (the job id, None) when SLURM took it, (the job id, why) when not."""
    job = slurm_job_id(env)
    if job is None:
        return "?", "SLURM_JOB_ID is not set"
    try:
        done = run(["scontrol", "requeue", job], env=dict(env), capture_output=True, text=True,
                   timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return job, f"cannot run scontrol: {exc}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout or "").strip().splitlines()
        return job, f"scontrol exited with {done.returncode}" + (f": {why[-1]}" if why else "")
    return job, None


def warning_names(config: RunConfig) -> frozenset[int]:
    return frozenset(int(signal.Signals[name]) for name in config.preempt_signals)

