"""torchrun's command line parsed into RunConfig with torchrun's meaning: no processes, no torch."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from multigpu.cli.main import main
from multigpu.cli.options import TORCHRUN, comma_list
from multigpu.cli.run_args import parse_run_args
from multigpu.cli.run_parser import run_parser
from multigpu.cluster import devices
from multigpu.cluster.devices import GPUInfo
from multigpu.config.endpoint import Endpoint
from multigpu.config.run import RunConfig
from multigpu.config.streams import StdStreams
from multigpu.contract.environment import usable_cpu_count
from multigpu.contract.errors import UsageError


def parse(argv: list[str], env: dict[str, str] | None = None) -> RunConfig:
    return parse_run_args(argv, env or {})[0]


def usage_error(argv: list[str], env: dict[str, str] | None = None) -> str:
    with pytest.raises(UsageError) as info:
        parse(argv, env)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_every_torchrun_option_is_in_the_table() -> None:
    import torch.distributed.run as run  # the specification: torch 2.13's own parser

    theirs = {s for a in run.get_args_parser()._actions for s in a.option_strings} - {"-h", "--help"}
    ours = {flag for opt in TORCHRUN for flag in opt.flags}
    assert theirs == ours


@pytest.mark.parametrize(
    "spelling",
    [
        ["--nproc-per-node", "2"],
        ["--nproc_per_node", "2"],
        ["--nproc-per-node=2"],
        ["--nproc_per_node=2"],
    ],
)
def test_both_spellings_and_both_value_forms(script: str, spelling: list[str]) -> None:
    config = parse([*spelling, script, "--nproc_per_node", "9"])
    assert (config.device, config.nproc, config.target_args) == ("cpu", 2, ("--nproc_per_node", "9"))


def test_unique_prefixes_of_torchruns_options_as_argparse_takes_them(script: str) -> None:
    config = parse(["--nnode=1", "--nproc_per", "2", "--master_p", "29511", script])
    assert (config.nproc, config.rdzv.endpoint) == (2, Endpoint("127.0.0.1", 29511))
    assert "--rdzv" in usage_error(["--rdzv", "x", script])  # ambiguous: refused, as under torchrun
    assert "--out" in usage_error(["--out", "dir", script])  # ours stay whole words


def test_pet_variables_and_precedence(script: str) -> None:
    env = {
        "PET_NPROC_PER_NODE": "3",
        "PET_MAX_RESTARTS": "2",
        "PET_RDZV_CONF": "join_timeout=7",
        "PET_STANDALONE": "1",
        "PET_ROLE": "trainer",
    }
    config = parse([script], env)
    assert (config.nproc, config.supervision.max_restarts, config.rdzv.timeout) == (3, 2, 7.0)
    assert (config.rdzv.backend, config.start.role) == ("c10d", "trainer")
    # command line, then MULTIGPU_, then PET_
    assert parse([script], {**env, "MULTIGPU_MAX_RESTARTS": "1"}).supervision.max_restarts == 1
    given = parse(["--max-restarts", "0", script], {**env, "MULTIGPU_MAX_RESTARTS": "1"})
    assert given.supervision.max_restarts == 0
    assert parse([script], {"PET_NPROC_PER_NODE": "3", "MULTIGPU_CPU": "2"}).nproc == 2
    assert parse(["--nproc-per-node", "1", script], {"MULTIGPU_CPU": "2"}).nproc == 1
    assert parse([script], {"PET_STANDALONE": "0"}).rdzv.backend == "static"
    assert "PET_NO_PYTHON" in usage_error([script], {"PET_NO_PYTHON": "yes"})


def test_nproc_per_node_without_gpu(script: str) -> None:
    assert (
        parse(["--nproc-per-node", "2", script]).device,
        parse(["--nproc-per-node", "2", script]).nproc,
    ) == ("cpu", 2)
    assert parse(["--nproc-per-node", "cpu", script]).nproc == usable_cpu_count()
    assert parse(["--nproc-per-node", "auto", script]).device == "cpu"
    assert "no GPU is visible" in usage_error(["--nproc-per-node", "gpu", script])
    assert "--nproc-per-node" in usage_error(["--nproc-per-node", "zero", script])
    assert "--nproc-per-node must be at least 1" in usage_error(["--nproc-per-node", "0", script])


@pytest.mark.usefixtures("four_gpus")
def test_nproc_per_node_with_gpus_uses_gpu_i_for_local_rank_i(script: str) -> None:
    config = parse(["--nproc-per-node", "2", script])
    assert (config.device, config.nproc, config.gpus) == ("cuda", 2, (0, 1))
    assert parse(["--nproc-per-node", "gpu", script]).gpus == (0, 1, 2, 3)
    assert parse(["--nproc-per-node", "auto", script]).gpus == (0, 1, 2, 3)
    assert parse(["--nproc-per-node", "cpu", script]).device == "cpu"
    assert "only 4 GPU(s)" in usage_error(["--nproc-per-node", "5", script])
    assert "not --gpus and --nproc-per-node" in usage_error(["--gpus", "0", "--nproc-per-node", "1", script])


def test_nproc_per_node_lands_on_the_physical_gpu_torchrun_would_use(
    monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    """Under torchrun rank i calls set_device(i) among the visible GPUs; here it sees only its chosen
    GPUs, in order, so set_device(i) names the same physical GPU."""
    monkeypatch.setattr(
        devices, "_nvml_gpus", lambda: [GPUInfo(index=i, ordinal=str(i), name="Fake") for i in range(4)]
    )
    env = {"CUDA_VISIBLE_DEVICES": "3,1,2,0"}
    config = parse(["--nproc-per-node", "2", script], env)
    visible = devices.visible_gpus(env)
    under_torchrun = [visible[i].ordinal for i in range(2)]  # physical GPU of set_device(LOCAL_RANK)
    ours = devices.cuda_visible_devices_for(list(config.gpus), visible).split(",")
    assert ours == under_torchrun == ["3", "1"]


@pytest.mark.usefixtures("four_gpus")
def test_a_torchrun_line_without_nproc_gets_torchruns_one_worker(script: str) -> None:
    line = parse(["--nnodes=2", "--node_rank=0", "--master_addr=h", "--master_port=1", script])
    assert (line.device, line.nproc, line.gpus, line.world_size) == ("cuda", 1, (0,), 2)
    assert parse(["--standalone", script]).nproc == 1
    assert parse([script], {"PET_NNODES": "1", "PET_MASTER_ADDR": "h"}).nproc == 1
    # ours, or options both launchers share: every visible GPU, as before
    assert parse([script]).nproc == 4
    assert parse(["--max-restarts", "1", script]).nproc == 4
    assert parse([script], {"PET_STANDALONE": "0"}).nproc == 4


def test_standalone_is_one_node_on_a_free_port(script: str) -> None:
    config = parse(["--standalone", "--rdzv-endpoint", "10.1.1.1:1234", "--nproc-per-node", "2", script])
    assert (config.rdzv.backend, config.rdzv.endpoint, config.multi_node) == ("c10d", None, False)
    assert "--standalone is one node" in usage_error(["--standalone", "--nnodes", "2", script])


def test_static_rendezvous_from_master_addr_and_port(script: str) -> None:
    config = parse(
        [
            "--nnodes=2",
            "--node_rank=1",
            "--master_addr=10.0.0.5",
            "--master_port=1234",
            "--nproc_per_node=2",
            script,
        ]
    )
    assert config.rdzv.endpoint == Endpoint("10.0.0.5", 1234)
    assert (config.base_rank, config.world_size, config.node_rank, config.nnodes) == (2, 4, 1, 2)
    assert (config.rdzv.min_nodes, config.rdzv.max_nodes, config.rdzv.backend) == (2, 2, "static")
    # torchrun's defaults: node rank 0, port 29500 over several nodes
    default = parse(["--nnodes", "2", "--master-addr", "host0", script])
    assert (default.rdzv.endpoint, default.node_rank, default.base_rank) == (Endpoint("host0", 29500), 0, 0)
    # one node with a port: the workers see that port, as under torchrun
    assert parse(["--master-port", "29511", script]).rdzv.endpoint == Endpoint("127.0.0.1", 29511)
    assert parse(["--master-addr", "127.0.0.1", script]).rdzv.endpoint is None
    # an explicit endpoint beats master addr/port
    assert parse(
        ["--nnodes", "2", "--rdzv-endpoint", "h:7", "--master-port", "9", script]
    ).rdzv.endpoint == Endpoint("h", 7)


def test_c10d_on_one_node_and_refusals(script: str) -> None:
    config = parse(
        [
            "--nnodes",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            "--rdzv-id",
            "job7",
            script,
        ]
    )
    assert (config.rdzv.backend, config.rdzv.endpoint, config.output.run_id) == (
        "c10d",
        Endpoint("localhost", 0),
        "job7",
    )
    # FlagAI's BMTrain example: a c10d endpoint without a port is torchrun's 29400
    assert parse(
        ["--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost", script]
    ).rdzv.endpoint == Endpoint("localhost", 29400)
    ipv6 = parse(["--rdzv_backend=c10d", "--rdzv_endpoint=[::1]", script])
    assert ipv6.rdzv.endpoint == Endpoint("::1", 29400)
    assert "no port" in usage_error(["--rdzv_endpoint=localhost", script])  # static needs one
    assert "needs --rdzv-endpoint" in usage_error(["--rdzv-backend", "etcd-v2", script])
    assert "needs --rdzv-endpoint" in usage_error(["--rdzv-backend", "etcd", script])
    assert "static, c10d or etcd-v2" in usage_error(["--rdzv-backend", "zk", script])
    assert "--rdzv-backend c10d" in usage_error(["--nnodes", "1:2", script])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3:1", "0 < MIN <= MAX"),
        ("0", "0 < MIN <= MAX"),
        ("a", "N or MIN:MAX"),
        ("1:2:3", "N or MIN:MAX"),
    ],
)
def test_bad_nnodes(script: str, value: str, message: str) -> None:
    assert message in usage_error(["--nnodes", value, script])


def test_rdzv_conf(script: str) -> None:
    config = parse(["--rdzv-conf", "join_timeout=30, read_timeout=60,is_host=false", script])
    assert config.rdzv.conf == {"join_timeout": "30", "read_timeout": "60", "is_host": "false"}
    assert config.rdzv.timeout == 30.0
    assert parse(["--rdzv-conf", "join_timeout=30", "--rdzv-timeout", "5", script]).rdzv.timeout == 5.0
    assert "--rdzv-conf" in usage_error(["--rdzv-conf", "junk", script])
    assert "--rdzv-conf" in usage_error(["--rdzv-conf", "a=1,=2", script])
    assert "join_timeout" in usage_error(["--rdzv-conf", "join_timeout=soon", script])
    assert "is_host" in usage_error(["--rdzv-conf", "is_host=maybe", script])


def test_synonyms_both_work_and_must_agree(script: str) -> None:
    assert parse(["--shutdown-timeout", "3", script]).supervision.grace_period == 3.0
    assert parse(["--shutdown-timeout", "3", "--grace-period", "3", script]).supervision.grace_period == 3.0
    assert "disagree" in usage_error(["--shutdown-timeout", "3", "--grace-period", "4", script])
    assert parse(["--rdzv_id", "abc", script]).output.run_id == "abc"
    assert "disagree" in usage_error(["--rdzv-id", "a", "--run-id", "b", script])
    # the command line's value beats the environment's synonym without a conflict
    ours = parse(["--grace-period", "1", script], {"PET_SHUTDOWN_TIMEOUT": "9"})
    assert ours.supervision.grace_period == 1.0


def test_local_ranks_filter_names_local_ranks(script: str) -> None:
    config = parse(["--nproc-per-node", "2", "--local-ranks-filter", "1", script])
    assert (config.output.log_ranks, config.output.local_ranks_filter) == (frozenset({1}), frozenset({1}))
    node1 = parse(
        [
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "h",
            "--local_ranks_filter=0",
            "--log-ranks",
            "2",
            script,
        ]
    )
    assert node1.output.log_ranks == frozenset({2})
    assert "disagree" in usage_error(["--local-ranks-filter", "0", "--log-ranks", "1", script])
    assert "--local-ranks-filter" in usage_error(["--local-ranks-filter", "x", script])


def test_module_no_python_and_run_path(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_mod_x.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for flag in ("-m", "--module"):
        config = parse(["--nproc-per-node", "2", flag, "my_mod_x", "--lr", "1"])
        assert (config.module, config.target, config.target_args) == (True, "my_mod_x", ("--lr", "1"))
    config = parse(["--no-python", "echo", "a", "b"])
    assert (config.start.run_mode, config.target, config.target_args, config.module) == (
        "exec",
        "echo",
        ("a", "b"),
        False,
    )
    assert parse(["--run-path", "--no-python", script]).start.run_mode == "python"
    assert "cannot be used together" in usage_error(["--no-python", "-m", "my_mod_x"])
    assert "not found or not executable" in usage_error(["--no_python", "no-such-program-xyz"])
    assert "needs a module name" in usage_error(["-m"])


def test_directory_and_zip_targets(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    assert "__main__.py" in usage_error([str(app)])
    (app / "__main__.py").write_text("")
    assert parse([str(app)]).target == str(app)
    archive = tmp_path / "app.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("__main__.py", "print(1)\n")
    assert parse([str(archive)]).target == str(archive)


def test_log_options(script: str, tmp_path: Path) -> None:
    config = parse(
        [
            "--log-dir",
            str(tmp_path),
            "-r",
            "3",
            "-t1",
            "--duplicate-stdout-filters",
            "loss,,x,acc",
            "--duplicate_stderr_filters=warn",
            script,
        ]
    )
    out = config.output
    assert (out.log_dir, out.redirects.text, out.tee.text) == (tmp_path, "3", "1")
    assert config.output.duplicate_stdout_filters == ("loss,x", "acc")
    assert config.output.duplicate_stderr_filters == ("warn",)
    assert parse(["--redirects=0:1,1:2", script]).output.redirects.text == "0:1,1:2"
    assert "--redirects" in usage_error(["-r", "4", script])
    assert "--tee" in usage_error(["--tee", "0:x", script])


def test_std_and_comma_list_as_torch_reads_them() -> None:
    from torch.distributed.elastic.multiprocessing.api import Std, to_map
    from torch.distributed.run import get_args_parser

    for text in ("0", "1", "2", "3", "0:1,1:2", "1:3"):
        theirs = to_map(Std.from_str(text), 3)
        ours = StdStreams.parse(text, "-r")
        for rank in range(3):
            names = ours.streams(rank)
            assert ("stdout" in names, "stderr" in names) == (
                bool(theirs[rank] & Std.OUT),
                bool(theirs[rank] & Std.ERR),
            )
    for text in ("a,b", "a,,b,c", "x"):
        ns = get_args_parser().parse_args(["--duplicate-stdout-filters", text, "s.py"])
        assert list(comma_list(text)) == ns.duplicate_stdout_filters


def test_options_torchrun_has_and_we_need_not_are_accepted_and_checked(script: str) -> None:
    config = parse(
        [
            "--monitor-interval",
            "0.5",
            "--start-method",
            "fork",
            "--event-log-handler",
            "console",
            "--signals-to-handle",
            "SIGTERM,SIGUSR1",
            "--role",
            "trainer",
            "--local-addr",
            "10.0.0.2",
            "--virtual-local-rank",
            "--numa-binding",
            "node",
            script,
        ]
    )
    start = config.start
    assert (start.role, config.rdzv.local_addr, start.virtual_local_rank, start.numa_binding) == (
        "trainer",
        "10.0.0.2",
        True,
        "node",
    )
    assert start.signals_to_handle == "SIGTERM,SIGUSR1"  # as written: the workers' variable
    assert parse([script]).start.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default
    assert "--monitor-interval" in usage_error(["--monitor-interval", "often", script])
    assert "--start-method" in usage_error([script], {"PET_START_METHOD": "thread"})
    assert "SIGNOPE" in usage_error(["--signals-to-handle", "SIGNOPE", script])
    assert "invalid choice" in usage_error(["--numa-binding", "far", script])
    assert "--logs-specs" in usage_error(["--logs-specs", "nope", script])
    assert "--role" in usage_error(["--role", " ", script])


def test_help_lists_both_sets_and_says_what_has_no_effect(capsys: pytest.CaptureFixture[str]) -> None:
    text = run_parser().format_help()
    for flag in (
        "--gpus",
        "--grace-period",
        "--hang-timeout",
        "--nproc_per_node",
        "--rdzv-conf",
        "--tee",
        "--no-python",
        "--virtual-local-rank",
        "--numa-binding",
    ):
        assert flag in text
    assert "multigpu options" in text and "torchrun options" in text
    assert text.count("no effect here") == 3  # monitor interval, start method, event log
    assert "(default 5)" in text  # read from RunConfig
    assert main(["run", "--nnodes", "3:1", "x.py"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "--nnodes 3:1" in err[0] and len(err) == 2


def test_an_etcd_member_list_as_torchrun_writes_it_and_one_member(script: str) -> None:
    """torchrun refuses a list ("must be a dot-separated list of labels"): each member is ours to give
    python-etcd; ``etcd`` and ``etcd-v2`` both name torch's etcd-v2 backend."""
    members = "127.0.0.11:2379,127.0.0.12:2380,[::1]:2381"
    for name in ("etcd", "etcd-v2", "ETCD-V2"):
        config = parse(["--nnodes", "2:3", "--rdzv-backend", name, "--rdzv-endpoint", members, script])
        assert config.rdzv.backend == "etcd-v2"
        assert config.rdzv.members == (
            Endpoint("127.0.0.11", 2379),
            Endpoint("127.0.0.12", 2380),
            Endpoint("::1", 2381),
        )
        assert config.rdzv.endpoint == Endpoint("127.0.0.11", 2379)
        assert (config.rdzv.min_nodes, config.rdzv.max_nodes) == (2, 3)
    one = parse(["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd-host", script])
    assert one.rdzv.members == (Endpoint("etcd-host", 2379),)  # etcd's port, as torch defaults it
    conf = "protocol=https,cacert=/ca.pem,cert=/c.pem,key=/k.pem,timeout=30"
    tls = parse(
        [
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "etcd-v2",
            "--rdzv-endpoint",
            members,
            "--rdzv-conf",
            conf,
            script,
        ]
    )
    assert tls.rdzv.conf["protocol"] == "https" and tls.rdzv.timeout == 30.0  # etcd's join timeout
    alone = parse(["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", members, script])
    assert alone.rdzv.members == () and alone.rdzv.endpoint is None  # one node needs no etcd


@pytest.mark.parametrize(
    ("endpoint", "conf", "message"),
    [
        ("h1:2379,,h3:2379", "", "HOST:PORT,HOST:PORT"),
        ("h1:2379,h1:2379", "", "names a member twice"),
        ("h1:0", "", "needs its client port"),
        ("h1:99999", "", "from 0 to 65535"),
        ("::1:2379", "", "in brackets"),
        ("h1:2379", "protocol=ftp", "http or https"),
        ("h1:2379", "key=/k.pem", "needs cert too"),
        ("h1:2379", "read_timeout=-1", "read_timeout"),
    ],
)
def test_etcd_usage_mistakes_are_one_line(script: str, endpoint: str, conf: str, message: str) -> None:
    argv = ["--nnodes", "2:3", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", endpoint]
    assert message in usage_error([*argv, *(["--rdzv-conf", conf] if conf else []), script])
