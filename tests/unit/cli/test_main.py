"""``multigpu run`` argument parsing into RunConfig: no processes, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multigpu.cli.run_args import parse_run_args
from multigpu.cli.run_parser import split_run_argv
from multigpu.config.endpoint import Endpoint
from multigpu.config.run import RunConfig
from multigpu.contract.errors import UsageError


def parse(argv: list[str], env: dict[str, str] | None = None) -> RunConfig:
    config, _ = parse_run_args(argv, env or {})
    return config


def test_defaults_without_gpu_are_one_cpu_worker_with_a_note(script: str) -> None:
    config, note = parse_run_args([script], {})
    assert (config.device, config.nproc, config.gpus) == ("cpu", 1, ())
    assert note is not None and "--cpu N" in note
    assert config.target == script and config.target_args == () and not config.module
    assert (config.base_rank, config.world_size) == (0, 1)
    assert (config.rdzv.endpoint, config.output.run_id) == (None, None)
    assert (config.output.dir, config.output.log_ranks) == (None, None)
    assert (config.supervision.max_restarts, config.output.status) == (0, "auto")
    assert config.supervision.grace_period == 5.0 and config.rdzv.timeout == 600.0
    assert config.hang.timeout is None


def test_straggler_threshold_is_a_share_of_the_step_0_for_off(script: str) -> None:
    assert parse(["--cpu", "2", script]).hang.straggler_threshold == 0.2
    assert parse(["--cpu", "2", "--straggler-threshold", "0.3", script]).hang.straggler_threshold == 0.3
    assert parse(["--cpu", "2", "--straggler-threshold", "0", script]).hang.straggler_threshold == 0


def test_steps_is_the_jobs_step_count_for_its_eta(script: str) -> None:
    assert parse(["--cpu", "2", script]).output.steps is None
    assert parse(["--cpu", "2", "--steps", "1000", script]).output.steps == 1000
    assert parse(["--cpu", "2", script], {"MULTIGPU_STEPS": "7"}).output.steps == 7
    for bad, said in (("0", "--steps must be at least 1, got 0"), ("ten", "--steps must be an integer")):
        with pytest.raises(UsageError, match=said):
            parse(["--cpu", "2", "--steps", bad, script])


def test_preflight_is_on_off_or_strict_and_no_preflight_turns_it_off(script: str) -> None:
    assert parse(["--cpu", "2", script]).rdzv.preflight == "auto"
    assert parse(["--cpu", "2", "--preflight", "strict", script]).rdzv.preflight == "strict"
    assert parse(["--cpu", "2", "--no-preflight", script]).rdzv.preflight == "off"
    assert parse(["--cpu", "2", script], {"MULTIGPU_PREFLIGHT": "off"}).rdzv.preflight == "off"
    assert parse(["--cpu", "2", "--nnodes", "2", "--node-rank", "0", script]).preflight_mode == "on"


def test_preflight_alone_means_on_and_leaves_the_script_its_target(script: str) -> None:
    config = parse(["--cpu", "2", "--preflight", script, "--lr", "1"])
    assert config.rdzv.preflight == "on" and config.target == script and config.target_args == ("--lr", "1")
    assert parse(["--cpu", "2", "--preflight", "--", script]).rdzv.preflight == "on"
    assert parse(["--preflight", "--cpu", "2", script]).rdzv.preflight == "on"
    assert parse(["--cpu", "2", "--preflight=strict", script]).rdzv.preflight == "strict"
    assert parse(["--cpu", "2", "--preflight", "off", script]).rdzv.preflight == "off"


def test_cpu_workers(script: str) -> None:
    config, note = parse_run_args(["--cpu", "3", script], {})
    assert (config.device, config.nproc, config.world_size, note) == ("cpu", 3, 3, None)


def test_script_args_split_from_ours(script: str) -> None:
    config = parse(
        [
            "--cpu",
            "2",
            "--output",
            "out",
            script,
            "--cpu",
            "5",
            "--gpus=1",
            "-m",
            "x",
            "--output",
            "y",
            "--bogus",
            "--",
            "z",
        ]
    )
    assert config.nproc == 2 and config.output.dir == Path("out")
    assert config.target_args == ("--cpu", "5", "--gpus=1", "-m", "x", "--output", "y", "--bogus", "--", "z")


def test_equals_form_of_our_options(script: str) -> None:
    config = parse(["--cpu=2", "--log-ranks=0", script, "a"])
    assert config.nproc == 2 and config.output.log_ranks == frozenset({0}) and config.target_args == ("a",)


def test_double_dash_ends_our_options(tmp_path: Path) -> None:
    odd = tmp_path / "-odd.py"
    odd.write_text("")
    config = parse(["--cpu", "2", "--", str(odd), "--cpu", "1"])
    assert config.target == str(odd) and config.target_args == ("--cpu", "1")


def test_split_run_argv() -> None:
    assert split_run_argv(["--cpu", "2", "s.py", "--cpu", "3"]) == (["--cpu", "2"], ["s.py", "--cpu", "3"])
    assert split_run_argv(["-m", "pkg.mod", "--cpu", "3"]) == (["-m"], ["pkg.mod", "--cpu", "3"])
    assert split_run_argv(["-mpkg", "x"]) == (["-m"], ["pkg", "x"])
    assert split_run_argv(["--nproc_per_node", "2", "-r", "3", "--standalone", "s.py", "-r", "1"]) == (
        ["--nproc_per_node", "2", "-r", "3", "--standalone"],
        ["s.py", "-r", "1"],
    )
    assert split_run_argv(["--cpu", "2"]) == (["--cpu", "2"], [])


def test_module_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_train_mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = parse(["--cpu", "2", "-m", "my_train_mod", "--cpu", "9", "pos"])
    assert config.module and config.target == "my_train_mod"
    assert config.target_args == ("--cpu", "9", "pos")
    assert parse(["-mjson.tool", "a"]).target == "json.tool"


def test_module_not_found() -> None:
    with pytest.raises(UsageError, match="no_such_module_xyz"):
        parse(["--cpu", "1", "-m", "no_such_module_xyz"])


def test_environment_variables_fill_options(script: str) -> None:
    env = {
        "MULTIGPU_CPU": "3",
        "MULTIGPU_GRACE_PERIOD": "1.5",
        "MULTIGPU_OUTPUT": "/tmp/o",
        "MULTIGPU_LOG_RANKS": "0,2",
        "MULTIGPU_RDZV_ENDPOINT": "127.0.0.1:0",
        "MULTIGPU_RUN_ID": "myrun",
        "MULTIGPU_HANG_TIMEOUT": "30",
        "MULTIGPU_MAX_RESTARTS": "2",
        "MULTIGPU_STATUS": "off",
        "MULTIGPU_RDZV_TIMEOUT": "9",
    }
    config = parse([script], env)
    assert (config.device, config.nproc) == ("cpu", 3)
    assert config.supervision.grace_period == 1.5 and config.output.dir == Path("/tmp/o")
    assert config.output.log_ranks == frozenset({0, 2}) and config.rdzv.endpoint == Endpoint("127.0.0.1", 0)
    assert config.output.run_id == "myrun" and config.hang.timeout == 30.0
    assert config.supervision.max_restarts == 2
    assert config.output.status == "off" and config.rdzv.timeout == 9.0


def test_command_line_wins_over_environment(script: str) -> None:
    env = {"MULTIGPU_CPU": "3", "MULTIGPU_GRACE_PERIOD": "1.5", "MULTIGPU_STATUS": "on"}
    config = parse(["--cpu", "2", "--grace-period", "0", "--status", "off", script], env)
    assert (config.nproc, config.supervision.grace_period, config.output.status) == (2, 0.0, "off")


@pytest.mark.usefixtures("four_gpus")
def test_command_line_device_choice_beats_the_other_from_environment(script: str) -> None:
    config = parse(["--gpus", "1", script], {"MULTIGPU_CPU": "3"})
    assert (config.device, config.gpus) == ("cuda", (1,))
    config = parse(["--cpu", "2", script], {"MULTIGPU_GPUS": "0,1"})
    assert (config.device, config.nproc) == ("cpu", 2)


def test_bad_environment_value_is_a_usage_error(script: str) -> None:
    with pytest.raises(UsageError, match="MULTIGPU_STATUS"):
        parse([script], {"MULTIGPU_STATUS": "loud"})
    with pytest.raises(UsageError, match="--cpu"):
        parse([script], {"MULTIGPU_CPU": "many"})


@pytest.mark.usefixtures("four_gpus")
def test_gpus_selection(script: str) -> None:
    config = parse(["--gpus", "2, 0", script])
    assert (config.device, config.nproc, config.gpus) == ("cuda", 2, (2, 0))
    assert parse(["--gpus", "all", script]).gpus == (0, 1, 2, 3)
    default = parse([script])
    assert (default.device, default.nproc, default.gpus) == ("cuda", 4, (0, 1, 2, 3))
    with pytest.warns(UserWarning, match="duplicate"):
        assert parse(["--gpus", "1,1", script]).gpus == (1,)


@pytest.mark.usefixtures("four_gpus")
def test_gpus_out_of_range_is_a_usage_error(script: str) -> None:
    with pytest.raises(UsageError, match="GPU 9 is not visible"):
        parse(["--gpus", "0,9", script])


def test_gpus_on_a_machine_without_gpu_says_use_cpu(script: str) -> None:
    with pytest.raises(UsageError, match="--cpu N"):
        parse(["--gpus", "0", script])
    with pytest.raises(UsageError, match="--cpu N"):
        parse(["--gpus", "all", script])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cpu", "abc", "{script}"], "--cpu must be an integer, got 'abc'"),
        (["--cpu", "0", "{script}"], "--cpu must be at least 1, got 0"),
        (["--cpu", "-1", "{script}"], "--cpu must be at least 1, got -1"),
        (["--gpus", "a", "{script}"], "'a'"),
        (["--gpus", "99", "{script}"], "--cpu N"),
        (["--cpu", "1"], "no script given"),
        ([], "no script given"),
        (["--cpu", "1", "{missing}"], "not found"),
        (["--bogus", "{script}"], "--bogus"),
        (["--cpu", "1", "--rdzv-endpoint", "localhost", "{script}"], "no port"),
        (["--cpu", "1", "--rdzv-endpoint", "127.0.0.1:x", "{script}"], "port must be a number"),
        (["--cpu", "2", "--gpus", "0", "{script}"], "not --gpus and --cpu"),
        (["--cpu"], "expected one argument"),
        (["--status", "loud", "{script}"], "invalid choice"),
        (["--log-ranks", "0,a", "{script}"], "'a'"),
        (["--grace-period", "-1", "{script}"], "--grace-period"),
        (["--rdzv-timeout", "0", "{script}"], "--rdzv-timeout"),
        (["--max-restarts", "x", "{script}"], "--max-restarts"),
        (
            ["--straggler-threshold", "-0.1", "{script}"],
            "--straggler-threshold must be a number of at least 0",
        ),
        (["--straggler-threshold", "x", "{script}"], "--straggler-threshold"),
        (["--preflight", "maybe", "{script}"], "invalid choice"),
        (["--preflight", "strict", "--no-preflight", "{script}"], "cannot be used together"),
        (["--cpu", "1", "--rdzv-endpoint", "10.0.0.1:0", "{script}"], "port 0"),
        # an abbreviation is not silently taken for the full option (it would eat the script's name)
        (["--out", "dir", "{script}"], "--out"),
    ],
)
def test_bad_input_is_a_usage_error(argv: list[str], message: str, script: str, tmp_path: Path) -> None:
    argv = [a.format(script=script, missing=str(tmp_path / "missing.py")) for a in argv]
    with pytest.raises(UsageError) as info:
        parse(argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_main_reports_usage_errors_in_two_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from multigpu.cli.main import main

    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "multigpu: error: unknown command 'frobnicate'; try 'multigpu --help'"
    assert main([]) == 2
    assert "usage: multigpu" in capsys.readouterr().out
    assert main(["demo", "--gpus", "0"]) == 2  # no GPU here (monkeypatched): a usage error, no traceback
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--cpu N" in err[0]


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("--nproc-pernode", "--nproc-per-node"),
        ("--nproc_pernode=2", "--nproc-per-node"),
        ("--grace-perod", "--grace-period"),
        ("--zzz", None),
    ],
)
def test_unknown_option_suggests_the_closest(script: str, typo: str, meant: str | None) -> None:
    """A typo (not a torchrun abbreviation, which is taken) is answered with the option meant."""
    from multigpu.cli.options import suggest

    assert suggest(typo) == meant
    with pytest.raises(UsageError, match=f"did you mean '{meant}'" if meant else "unrecognized"):
        parse([typo, script])


def test_the_debug_server_is_on_loopback_unless_a_host_is_given(script: str) -> None:
    from multigpu.contract.names import DEBUG_SERVER_ENV

    config = parse(["--cpu", "2", "--debug-server", "8000", script])
    assert config.start.debug_server == Endpoint("127.0.0.1", 8000)
    host, port, token = json.loads(config.extra_env[DEBUG_SERVER_ENV])
    assert (host, port) == ("127.0.0.1", 8000) and len(token) >= 20  # the run's token: fresh each run
    assert json.loads(parse(["--debug-server", "8000", script]).extra_env[DEBUG_SERVER_ENV])[2] != token
    assert parse(["--debug-server", "0.0.0.0:8001", script]).start.debug_server == Endpoint("0.0.0.0", 8001)
    named = parse(["--debug-server", "localhost:8002", script]).extra_env[DEBUG_SERVER_ENV]
    assert json.loads(named)[:2] == ["127.0.0.1", 8002]
    assert parse([script]).start.debug_server is None
    with pytest.raises(UsageError, match=r"^--debug-server 'host:port': the port must be a number"):
        parse(["--debug-server", "host:port", script])


def test_the_debug_token_can_be_the_users_own_for_several_nodes(script: str) -> None:
    """Each node's launcher makes its own token unless MULTIGPU_DEBUG_TOKEN names one: the page signs
    its requests to every node's ranks with its own, so several nodes need the same."""
    from multigpu.contract.names import DEBUG_SERVER_ENV

    shared = "Shared_token-0123456789"
    env = {"MULTIGPU_DEBUG_TOKEN": shared}
    assert json.loads(parse(["--debug-server", "8000", script], env).extra_env[DEBUG_SERVER_ENV])[2] == shared
    unset = parse(["--debug-server", "8000", script], {"MULTIGPU_DEBUG_TOKEN": ""}).extra_env
    assert len(json.loads(unset[DEBUG_SERVER_ENV])[2]) >= 20  # empty counts as unset
    for bad in ("short", "with space in it, long enough", "semi;colon-0123456789"):
        with pytest.raises(UsageError, match=r"^MULTIGPU_DEBUG_TOKEN must be at least 16 letters, digits"):
            parse(["--debug-server", "8000", script], {"MULTIGPU_DEBUG_TOKEN": bad})
    assert DEBUG_SERVER_ENV not in parse([script], {"MULTIGPU_DEBUG_TOKEN": "bad"}).extra_env


def test_the_debug_server_port_must_be_named_and_free(script: str) -> None:
    import socket

    with pytest.raises(UsageError, match=r"^--debug-server needs a port to open in a browser"):
        parse(["--debug-server", "0", script])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=rf"^--debug-server 127\.0\.0\.1:{port}: cannot listen there \("):
            parse(["--debug-server", str(port), script])


def test_the_options_object_is_the_option_table() -> None:
    """Each ``RunOptions`` field is one option: flags are ``bool | None``, the rest ``str | None``; its name
    is the longest flag's (so ``MULTIGPU_<OPTION>`` is the option's name); synonyms and torchrun's shared
    options name fields."""
    import dataclasses

    from multigpu.cli import options

    fields = dataclasses.fields(options.RunOptions)
    assert [f.name for f in fields] == [opt.dest for opt in options.ALL]
    assert options.ALL == options.OURS + options.TORCHRUN  # ours first, then torchrun's
    for f, opt in zip(fields, options.ALL, strict=True):
        assert f.type == ("str | None" if opt.takes_value else "bool | None"), f.name
        longest = max((flag for flag in opt.flags if flag.startswith("--")), key=len)
        assert f.name == longest.lstrip("-").replace("-", "_")
    names = {f.name for f in fields}
    assert {name for pair in options.SYNONYMS for name in pair} <= names
    assert names >= options.SHARED


def test_resolved_options_are_typed() -> None:
    import dataclasses

    from multigpu.cli import options

    values = options.resolve(
        {"cpu": "2", "standalone": True},
        {"MULTIGPU_REQUEUE": "0", "PET_RDZV_ID": "job", "PET_NO_PYTHON": "1"},
    )
    assert (values.cpu, values.standalone, values.requeue, values.no_python) == ("2", True, False, True)
    assert (values.run_id, values.rdzv_id, values.gpus, values.no_requeue) == ("job", "job", None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        values.cpu = "3"  # type: ignore[misc]


def test_the_metrics_port_is_on_loopback_unless_a_host_is_given(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse(["--cpu", "2", "--metrics-port", "9400", script]).output.metrics == Endpoint(
        "127.0.0.1", 9400
    )
    assert parse(["--metrics-port", "0.0.0.0:0", script]).output.metrics == Endpoint("0.0.0.0", 0)
    assert parse([script], {"MULTIGPU_METRICS_PORT": "0"}).output.metrics == Endpoint("127.0.0.1", 0)
    assert parse([script]).output.metrics is None
    from multigpu.observe import serving

    monkeypatch.setattr(serving.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"^--metrics-port needs prometheus_client: pip install"):
        parse(["--metrics-port", "0", script])
