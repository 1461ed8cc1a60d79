"""``multigpu.launch``'s settings into the one RunConfig, and its devices. No processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from multigpu.cluster.devices import GPUInfo
from multigpu.config.endpoint import Endpoint
from multigpu.config.run import RunConfig
from multigpu.contract.errors import UsageError
from multigpu.function.launch_config import OPTIONS, launch_config, resolve_devices


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    found = [GPUInfo(index=i, ordinal=str(i), name="gpu", uuid=f"GPU-{i}") for i in range(count)]
    import multigpu.function.launch_config as lc

    monkeypatch.setattr(lc, "visible_gpus", lambda env=None: found)


def test_no_gpu_asks_for_nprocs_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 0)
    with pytest.raises(UsageError, match="no GPU is visible here; pass nprocs=N") as info:
        resolve_devices(None, "auto", {})
    assert "\n" not in str(info.value)
    assert resolve_devices(3, "auto", {}) == ("cpu", 3, ())


def test_auto_takes_every_gpu_or_the_first_nprocs(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(monkeypatch, 4)
    assert resolve_devices(None, "auto", {}) == ("cuda", 4, (0, 1, 2, 3))
    assert resolve_devices(2, "cuda", {}) == ("cuda", 2, (0, 1))
    assert resolve_devices(8, "cpu", {}) == ("cpu", 8, ())
    with pytest.raises(UsageError, match="5 GPU rank"):
        resolve_devices(5, "auto", {})


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_nprocs_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="nprocs"):
        resolve_devices(bad, "cpu", {})  # type: ignore[arg-type]


def test_device_is_checked() -> None:
    with pytest.raises(ValueError, match="device must be"):
        resolve_devices(2, "tpu", {})


def test_options_land_in_their_one_field(tmp_path: Path) -> None:
    config = launch_config(
        2,
        "cpu",
        {
            "hang_timeout": 30.0,
            "max_restarts": 2,
            "grace_period": 1.5,
            "output": tmp_path / "out",
            "log_ranks": [0],
            "preload": ["json"],
            "metrics_port": 0,
        },
        {},
    )
    assert isinstance(config, RunConfig) and config.function and config.nproc == 2
    assert config.hang.timeout == 30.0 and config.supervision.max_restarts == 2
    assert config.supervision.grace_period == 1.5 and config.supervision.preload == ("json",)
    assert config.output.dir == (tmp_path / "out").resolve() and config.output.log_ranks == frozenset({0})
    assert config.output.status == "off" and config.output.run_id
    assert config.output.metrics == Endpoint("127.0.0.1", 0)
    assert config.output.steps is None
    assert launch_config(1, "cpu", {"steps": 500}, {}).output.steps == 500
    with pytest.raises(UsageError, match="launch: steps must be at least 1, got 0"):
        launch_config(1, "cpu", {"steps": 0}, {})


def test_default_output_is_the_users_cache_folder_not_the_working_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A loop of launches must not leave one ``multigpu_runs/<id>`` per call where it runs."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config = launch_config(1, "cpu", {"run_id": "abc"}, {"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert config.output.dir == tmp_path / "cache" / "multigpu" / "runs" / "abc"
    assert list(work.iterdir()) == []
    home = launch_config(1, "cpu", {"run_id": "b"}, {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": "rel"})
    assert home.output.dir == tmp_path / "home" / ".cache" / "multigpu" / "runs" / "b"
    assert (tmp_path / "home" / ".cache" / "multigpu" / "runs").stat().st_mode & 0o777 == 0o700


def test_an_unknown_option_is_a_type_error_naming_the_known_ones() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'hang_timout'") as info:
        launch_config(1, "cpu", {"hang_timout": 3}, {})
    assert all(name in str(info.value) for name in OPTIONS)


def test_every_option_names_a_real_field() -> None:
    config = RunConfig(target="")
    for section, field in OPTIONS.values():
        assert hasattr(getattr(config, section), field), (section, field)


def test_options_are_checked_by_the_command_lines_parsers(tmp_path: Path) -> None:
    """The CLI's strings and Python's numbers and lists mean the same; a wrong value is one UsageError
    naming the option, in the caller, before anything starts."""
    config = launch_config(
        1,
        "cpu",
        {
            "hang_timeout": "5",
            "max_restarts": "2",
            "grace_period": 0,
            "hang_factor": 3,
            "log_ranks": "0,1",
            "preload": "json, os.path",
        },
        {},
    )
    assert config.hang.timeout == 5.0 and config.supervision.max_restarts == 2
    assert config.supervision.grace_period == 0.0 and config.hang.factor == 3.0
    assert config.output.log_ranks == frozenset({0, 1})
    assert config.supervision.preload == ("json", "os.path")
    assert launch_config(1, "cpu", {"log_ranks": 3, "hang_timeout": None}, {}).output.log_ranks == {3}


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("hang_timeout", "five", "hang_timeout must be a number of seconds"),
        ("hang_timeout", 0, "hang_timeout must be more than 0"),
        ("grace_period", -1, "grace_period must be at least 0"),
        ("max_restarts", 2.5, "max_restarts must be an integer"),
        ("max_restarts", True, "max_restarts must be a number"),
        ("hang_factor", 0.5, "hang_factor must be a number of at least 1"),
        ("output", 5, "output must be a folder path"),
        ("output", "", "output must be a folder path"),
        ("log_ranks", [0, -1], "log_ranks item '-1' is negative"),
        ("log_ranks", {"a": 1}, "log_ranks must be ranks"),
        ("preload", ["json", "not a module"], "preload takes module names"),
        ("template", "no", "template must be True or False"),
        ("run_id", "../x", "run_id '../x' is a path"),
    ],
)
def test_a_wrong_option_is_one_usage_error(name: str, value: object, says: str) -> None:
    with pytest.raises(UsageError, match="^multigpu.launch: " + says) as info:
        launch_config(1, "cpu", {name: value}, {})
    assert "\n" not in str(info.value)
