"""The servers' options: --metrics-port's value (loopback unless a host is given), a missing
prometheus_client in one line, TORCHELASTIC_HEALTH_CHECK_PORT checked, a port taken in one line, and
nothing served without either."""

from __future__ import annotations

import socket

import pytest

from multigpu.config.endpoint import Endpoint
from multigpu.config.run import OutputConfig, RunConfig
from multigpu.contract.errors import UsageError
from multigpu.observe import serving


def test_a_port_alone_is_loopback_and_a_host_is_kept() -> None:
    assert serving.metrics_endpoint("9400") == Endpoint("127.0.0.1", 9400)
    assert serving.metrics_endpoint("0.0.0.0:0") == Endpoint("0.0.0.0", 0)
    with pytest.raises(UsageError, match="--metrics-port 'x:y'"):
        serving.metrics_endpoint("x:y")


@pytest.mark.parametrize("given", ["70000", "-1", "", "abc"])
def test_a_wrong_port_alone_is_named_as_given(given: str) -> None:
    """A port alone is the usual value: its error names what the user wrote (not the loopback address
    the launcher put before it) and asks for a port, not for HOST:PORT."""
    with pytest.raises(UsageError) as caught:
        serving.metrics_endpoint(given)
    assert str(caught.value) == (
        f"--metrics-port {given!r}: write a port number from 0 to 65535, or HOST:PORT"
    )


def test_without_prometheus_client_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError) as caught:
        serving.metrics_endpoint("9400")
    assert str(caught.value) == "--metrics-port needs prometheus_client: pip install 'multigpu[metrics]'"


def test_the_health_port_variable() -> None:
    assert (
        serving.health_port({}) is None and serving.health_port({serving.health.HEALTH_PORT_ENV: ""}) is None
    )
    assert serving.health_port({serving.health.HEALTH_PORT_ENV: "8080"}) == 8080
    with pytest.raises(UsageError, match="TORCHELASTIC_HEALTH_CHECK_PORT must be a port number"):
        serving.health_port({serving.health.HEALTH_PORT_ENV: "http"})


def test_nothing_served_unless_asked() -> None:
    with serving.observed(RunConfig("x"), {}, {}, "r") as seen:
        assert seen is None


def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = RunConfig("x", output=OutputConfig(metrics=Endpoint("127.0.0.1", port)))
        taken_line = f"--metrics-port: cannot serve on 127.0.0.1:{port}: "
        with pytest.raises(UsageError, match=taken_line), serving.observed(config, {}, {}, "r"):
            pass
        env = {serving.health.HEALTH_PORT_ENV: str(port)}
        with (
            pytest.raises(
                UsageError, match=f"TORCHELASTIC_HEALTH_CHECK_PORT: cannot serve on 127.0.0.1:{port}"
            ),
            serving.observed(RunConfig("x"), env, {}, "r"),
        ):
            pass


def test_the_lost_seconds_provider_reaches_the_scrape() -> None:
    config = RunConfig("x", output=OutputConfig(metrics=Endpoint("127.0.0.1", 0)))
    with serving.observed(config, {"SLURM_JOB_ID": "77"}, {}, "r", lambda: {"preemption": 3.0}) as seen:
        assert seen is not None and seen.lost() == {"preemption": 3.0} and seen.slurm_job_id == "77"
