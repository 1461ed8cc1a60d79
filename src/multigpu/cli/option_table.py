"""The rows of ``multigpu run``'s option table: torchrun's options (torch 2.13 ``torch/distributed/run.py``)
and ours, each a dataclass field whose metadata holds its ``Option`` (flags, metavar, help).

``options.RunOptions`` joins the two classes here into the one frozen object the rest of ``cli`` reads;
``options`` also derives the splitter's and the parser's look-ups from these fields, so an option is
written down once. Runs in the launcher; imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from multigpu.config.endpoint import TORCHRUN_MASTER_PORT

OPTION = "multigpu.option"
"""The key of a ``RunOptions`` field's metadata that holds its ``Option``."""


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    """Every spelling; the first is the one ``--help`` shows first."""
    metavar: str | None
    """None: a flag that takes no value (torchrun's ``check_env`` flags)."""
    help: str
    torchrun: bool = False
    pet: bool = True
    """Whether torchrun reads ``PET_<DEST>`` for it (``--logs-specs``/``--numa-binding`` it does not)."""
    choices: tuple[str, ...] | None = None
    dest: str = ""
    """The ``RunOptions`` field that holds its value (argparse's dest too): set from the field's name."""
    bare: str | None = None
    """The value the flag alone means (``--preflight`` is ``--preflight on``); None: a value is required."""

    @property
    def takes_value(self) -> bool:
        return self.metavar is not None

    def value_in(self, word: str | None) -> bool:
        """Whether ``word``, the command line's next word, is this option's value. An option with a
        ``bare`` meaning takes only a word that could be a mode (one of ``choices``, or a misspelt one,
        which argparse then refuses naming the choices); a script (``train.py``, ``./job``), an option
        or the end of the line leaves it bare."""
        if word is None:
            return False
        if self.bare is None:
            return True
        return word in (self.choices or ()) or word.isalpha()

    def env_names(self) -> tuple[str, ...]:
        names = ("MULTIGPU_" + self.dest.upper(),)
        return (*names, "PET_" + self.dest.upper()) if self.torchrun and self.pet else names


def _text(
    flags: tuple[str, ...],
    metavar: str,
    help: str,
    torchrun: bool = False,
    pet: bool = True,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A ``RunOptions`` field for an option that takes a value: ``str | None``, None when not given."""
    return field(default=None, metadata={OPTION: Option(flags, metavar, help, torchrun, pet, choices)})


def _mode(flags: tuple[str, ...], help: str, choices: tuple[str, ...], bare: str) -> Any:
    """A ``RunOptions`` field for an option with a mode, ``bare`` when the flag is given alone."""
    option = Option(flags, "MODE", help, choices=choices, bare=bare)
    return field(default=None, metadata={OPTION: option})


def _flag(flags: tuple[str, ...], help: str, torchrun: bool = False) -> Any:
    """A ``RunOptions`` field for a flag: ``bool | None``; False when a variable sets it to 0."""
    return field(default=None, metadata={OPTION: Option(flags, None, help, torchrun)})


def _both(name: str) -> tuple[str, str]:
    """torchrun's two spellings of one option: dashes and underscores."""
    return (f"--{name}", f"--{name.replace('-', '_')}")


NO_EFFECT = "accepted; no effect here: "


@dataclass(frozen=True)
class OurOptions:
    """multigpu's own options, one field per option, in the order ``--help`` lists them within a group.

    A field's name is the option's dest (``MULTIGPU_<NAME>``); values stay text (a flag: True/False),
    None when no source gives the option (see ``options.RunOptions``).
    """

    gpus: str | None = _text(
        ("--gpus",), "SPEC", "visible GPU indices, e.g. 0,1, or 'all' (default: every visible GPU)"
    )
    cpu: str | None = _text(("--cpu",), "N", "run N CPU workers (gloo) instead of GPUs")
    output: str | None = _text(("--output",), "DIR", "run directory (default: ./multigpu_runs/<run id>)")
    run_id: str | None = _text(
        ("--run-id",),
        "ID",
        "job id shared by every node (default: generated, or SLURM_JOB_ID); same as --rdzv-id",
    )
    log_ranks: str | None = _text(
        ("--log-ranks",),
        "LIST",
        "global ranks shown on the console, e.g. 0,2 (log files keep every rank); "
        "--local-ranks-filter names local ranks",
    )
    rdzv_timeout: str | None = _text(
        ("--rdzv-timeout",),
        "S",
        "seconds to wait for peer nodes (default {rdzv_timeout}); also --rdzv-conf join_timeout=S",
    )
    base_rank: str | None = _text(
        ("--base-rank",), "R", "global rank of this node's first worker (multi-node)"
    )
    world_size: str | None = _text(("--world-size",), "W", "total workers over all nodes (multi-node)")
    allow_mismatch: bool | None = _flag(
        ("--allow-mismatch",),
        "run a multi-node job even when its nodes would run a different script, "
        "arguments, torch, multigpu or device kind (a warning instead of refusing it)",
    )
    preflight: str | None = _mode(
        ("--preflight",),
        "check every node (a matmul, all_reduce between the nodes) after the rendezvous, before any "
        "rank: on (also --preflight alone) warns of a node far slower than the others, strict refuses "
        "the job (exit 77), off skips it (default: on for several nodes, off for one)",
        choices=("on", "off", "strict"),
        bare="on",
    )
    no_preflight: bool | None = _flag(("--no-preflight",), "same as --preflight off")
    grace_period: str | None = _text(
        ("--grace-period",),
        "S",
        "seconds between SIGTERM and SIGKILL at teardown (default {grace_period}); "
        "same as --shutdown-timeout",
    )
    hang_timeout: str | None = _text(
        ("--hang-timeout",),
        "S",
        "stop the run, with stack dumps, after S seconds without progress; for "
        "ranks that report steps, the ceiling of a timeout learned from their step times",
    )
    hang_factor: str | None = _text(
        ("--hang-factor",), "F", "learned hang timeout: F x the slowest step interval (default {hang_factor})"
    )
    hang_floor: str | None = _text(
        ("--hang-floor",), "S", "learned hang timeouts are at least S seconds (default {hang_floor})"
    )
    straggler_threshold: str | None = _text(
        ("--straggler-threshold",),
        "F",
        "name a rank that enters collectives after this node's other "
        "ranks by more than F of their step (default {straggler_threshold}: the job runs 20% slower for "
        "it); 0: no straggler detection",
    )
    debug_server: str | None = _text(
        ("--debug-server",),
        "[HOST:]PORT",
        "serve torch's debug server (every rank's stacks, flight record, "
        "store) on PORT of rank 0's node, on loopback unless HOST is given (0.0.0.0: every interface, for "
        "several nodes); needs pip install 'multigpu[debug]'",
    )
    status: str | None = _text(
        ("--status",),
        "MODE",
        "live status view: auto (on a terminal), on, off",
        choices=("auto", "on", "off"),
    )
    metrics_port: str | None = _text(
        ("--metrics-port",),
        "[HOST:]PORT",
        "serve Prometheus metrics at /metrics on PORT of every node's launcher for the whole run, on "
        "loopback unless HOST is given (0: a free port, printed); needs pip install 'multigpu[metrics]'",
    )
    steps: str | None = _text(
        ("--steps",),
        "N",
        "the job's step count, as multigpu.heartbeat(step=...) counts: the live view and "
        "'multigpu status' show its progress and ETA",
    )
    # -- preemption and requeue
    preempt_signal: str | None = _text(
        ("--preempt-signal",),
        "SIGS",
        "signal(s) that warn of a preemption or the time limit, e.g. USR1 "
        "(#SBATCH --signal=USR1@90), or none; ranks see multigpu.preempted() (default under SLURM: "
        "USR1,USR2)",
    )
    preempt_grace: str | None = _text(
        ("--preempt-grace",),
        "S",
        "stop the ranks S seconds after the warning if they still run (default: "
        "wait for them, or for SLURM's SIGTERM)",
    )
    requeue: bool | None = _flag(
        ("--requeue",),
        "after a warning, once the ranks exit, 'scontrol requeue' the job and exit 75 "
        "(default under SLURM with a warning signal)",
    )
    no_requeue: bool | None = _flag(("--no-requeue",), "never requeue; a warned run still exits 75")
    # -- warm worker template
    no_template: bool | None = _flag(
        ("--no-template",),
        "start every rank as a fresh Python process instead of forking it from the "
        "node's template (which imports torch once per node)",
    )
    preload: str | None = _text(
        ("--preload",), "MODULES", "modules the template imports besides torch, comma separated"
    )


@dataclass(frozen=True)
class TorchrunOptions:
    """torchrun's options, one field per option, each with torchrun's meaning (``cli/torchrun`` maps
    them onto RunConfig); ``PET_<NAME>`` sets one as under torchrun unless its ``Option`` says not."""

    nnodes: str | None = _text(
        ("--nnodes",),
        "N|MIN:MAX",
        "node count, or an elastic range (MIN:MAX needs --rdzv-backend c10d or etcd-v2)",
        torchrun=True,
    )
    nproc_per_node: str | None = _text(
        _both("nproc-per-node"),
        "N|auto|gpu|cpu",
        "workers per node: N (N GPUs when GPUs are visible, else "
        "N CPU workers), gpu (every visible GPU), cpu (one CPU worker per usable core), auto (gpu if any, "
        "else cpu); default: 1 on a line with torchrun-only options, as torchrun, else every visible GPU",
        torchrun=True,
    )
    rdzv_backend: str | None = _text(
        _both("rdzv-backend"),
        "NAME",
        "static (default), c10d, or etcd-v2 (also 'etcd'; --rdzv-endpoint lists the etcd members)",
        torchrun=True,
    )
    rdzv_endpoint: str | None = _text(
        _both("rdzv-endpoint"),
        "HOST:PORT",
        "where the nodes meet (default: 127.0.0.1, a free port, on one "
        "node; --master-addr:--master-port for static)",
        torchrun=True,
    )
    rdzv_id: str | None = _text(_both("rdzv-id"), "ID", "same as --run-id", torchrun=True)
    rdzv_conf: str | None = _text(
        _both("rdzv-conf"),
        "K=V,...",
        "rendezvous settings: join_timeout (as --rdzv-timeout), read_timeout, "
        "last_call_timeout, close_timeout, is_host, ...",
        torchrun=True,
    )
    standalone: bool | None = _flag(
        ("--standalone",),
        "one node on a free local port; --rdzv-backend/-endpoint/-id are ignored, as under torchrun",
        torchrun=True,
    )
    max_restarts: str | None = _text(
        _both("max-restarts"),
        "K",
        "restart the whole group up to K times after a failure (default {max_restarts})",
        torchrun=True,
    )
    monitor_interval: str | None = _text(
        _both("monitor-interval"),
        "S",
        NO_EFFECT + "a worker's exit is seen at once (process descriptors), nothing is polled",
        torchrun=True,
    )
    start_method: str | None = _text(
        _both("start-method"),
        "METHOD",
        NO_EFFECT + "torchrun uses it only for function entry points; a "
        "script always starts as a fresh process, here too",
        torchrun=True,
        choices=("spawn", "fork", "forkserver"),
    )
    event_log_handler: str | None = _text(
        _both("event-log-handler"),
        "NAME",
        NO_EFFECT + "the run's events (attempts, failures, root cause) are written to run.json",
        torchrun=True,
    )
    role: str | None = _text(("--role",), "NAME", "the workers' ROLE_NAME (default {role})", torchrun=True)
    module: bool | None = _flag(
        ("-m", "--module"), "SCRIPT is a module, run as with python -m", torchrun=True
    )
    no_python: bool | None = _flag(
        _both("no-python"), "SCRIPT is a program to execute directly, not a Python script", torchrun=True
    )
    run_path: bool | None = _flag(
        _both("run-path"),
        "run SCRIPT with runpy.run_path (what multigpu always does for a script); beats --no-python",
        torchrun=True,
    )
    log_dir: str | None = _text(
        _both("log-dir"),
        "DIR",
        "also write torchrun's files: DIR/<run id>_<random>/attempt_<k>/<local "
        "rank>/{{stdout,stderr}}.log, error.json (per-rank logs in --output stay)",
        torchrun=True,
    )
    redirects: str | None = _text(
        ("-r", "--redirects"),
        "STD",
        "streams written to --log-dir files and not shown: 0 none, 1 stdout, 2 "
        "stderr, 3 both, or per local rank 0:1,1:2",
        torchrun=True,
    )
    tee: str | None = _text(
        ("-t", "--tee"),
        "STD",
        "streams written to --log-dir files and also shown (as --redirects)",
        torchrun=True,
    )
    local_ranks_filter: str | None = _text(
        _both("local-ranks-filter"),
        "LIST",
        "local ranks shown on the console (files keep every rank); see --log-ranks",
        torchrun=True,
    )
    duplicate_stdout_filters: str | None = _text(
        _both("duplicate-stdout-filters"),
        "WORDS",
        "copy stdout lines holding any of these words (comma "
        "separated, ',,' for a comma) to attempt_<k>/filtered_stdout.log in --log-dir",
        torchrun=True,
    )
    duplicate_stderr_filters: str | None = _text(
        _both("duplicate-stderr-filters"), "WORDS", "the same for stderr (filtered_stderr.log)", torchrun=True
    )
    node_rank: str | None = _text(
        _both("node-rank"), "I", "this node's index for a static rendezvous, with --nnodes", torchrun=True
    )
    master_addr: str | None = _text(
        _both("master-addr"),
        "HOST",
        "static rendezvous host (rank 0's node); with --master-port it is --rdzv-endpoint HOST:PORT",
        torchrun=True,
    )
    master_port: str | None = _text(
        _both("master-port"),
        "PORT",
        f"static rendezvous port (default {TORCHRUN_MASTER_PORT} on several "
        "nodes; one node without it gets a free port)",
        torchrun=True,
    )
    local_addr: str | None = _text(
        _both("local-addr"),
        "HOST",
        "the address this node announces in a c10d rendezvous (unused by static, as under torchrun)",
        torchrun=True,
    )
    logs_specs: str | None = _text(
        _both("logs-specs"),
        "NAME",
        "an installed torchrun.logs_specs entry point that decides where the -r/-t files and error files go",
        torchrun=True,
        pet=False,
    )
    numa_binding: str | None = _text(
        _both("numa-binding"),
        "MODE",
        "bind each rank to the CPUs (and memory) of its GPU's NUMA node (CPU "
        "workers: an equal share of the usable cores)",
        torchrun=True,
        pet=False,
        choices=("node", "socket", "exclusive", "core-complex"),
    )
    signals_to_handle: str | None = _text(
        _both("signals-to-handle"),
        "SIGS",
        "the workers' TORCHELASTIC_SIGNALS_TO_HANDLE, as under torchrun "
        "(names are checked); multigpu itself always passes SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 on "
        "to every rank's process group",
        torchrun=True,
    )
    shutdown_timeout: str | None = _text(
        _both("shutdown-timeout"), "S", "same as --grace-period", torchrun=True
    )
    virtual_local_rank: bool | None = _flag(
        _both("virtual-local-rank"),
        "LOCAL_RANK=0 in every worker; each GPU worker sees only its own GPU, as device 0",
        torchrun=True,
    )
