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

import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from multigpu.config.run import RunConfig
from multigpu.contract.environment import PREEMPTION_KEYS
from multigpu.contract.names import PREVIOUS_OUTPUT_ENV, RESUMED_ENV, WARNING_SIGNALS_ENV

WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
SLURM_DEFAULT = ("SIGUSR1", "SIGUSR2")
RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"
SCONTROL_TIMEOUT_S = 60.0


def under_slurm(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


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


def preemption_env(config: RunConfig, output_dir: Path, base_env: Mapping[str, str]) -> dict[str, str]:
    """``base_env`` with what the ranks need: the warning signals, the resume count, the previous folder."""
    env = {k: v for k, v in base_env.items() if k not in PREEMPTION_KEYS}
    if config.preemption.signals:
        env[WARNING_SIGNALS_ENV] = ",".join(config.preemption.signals)
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
        done = run(
            ["scontrol", "requeue", job],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return job, f"cannot run scontrol: {exc}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout or "").strip().splitlines()
        return job, f"scontrol exited with {done.returncode}" + (f": {why[-1]}" if why else "")
    return job, None


def warning_names(config: RunConfig) -> frozenset[int]:
    return frozenset(int(signal.Signals[name]) for name in config.preemption.signals)
