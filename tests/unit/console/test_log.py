"""The launcher's lines as log records (``console/log.py``): where each one shows, and only once.

A process of its own for what depends on the process's logging set-up (pytest's own handlers on the
root logger would hide the stand-in): a plain launcher-side process prints ``multigpu: <message>`` on
stderr; one whose application called ``logging.basicConfig`` prints each line once, in its format.
"""

from __future__ import annotations

import logging
import subprocess
import textwrap
import threading

import pytest

from helpers import PYTHON, logged
from multigpu.console.log import PACKAGE, lines_through
from multigpu.console.writer import Console, ConsoleWriter


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )


class Collecting(Console):
    """A run's console that keeps what it was told to say."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def say(self, message: str) -> None:
        self.said.append(message)


def test_records_propagate_to_caplog(caplog: pytest.LogCaptureFixture) -> None:
    logging.getLogger("multigpu.supervisor.loop").warning("hang: no progress")
    logging.getLogger("multigpu.runner.attempts").info("restarting: attempt 1 of 3 restart(s)")
    assert logged(caplog) == ["hang: no progress", "restarting: attempt 1 of 3 restart(s)"]
    assert [(r.name, r.levelno) for r in caplog.records] == [
        ("multigpu.supervisor.loop", logging.WARNING),
        ("multigpu.runner.attempts", logging.INFO),
    ]


def test_outside_a_run_a_line_goes_to_stderr_as_multigpu_says_it() -> None:
    result = run_python(
        """
        import logging
        import multigpu.console.log
        logging.getLogger("multigpu.runner.static_join").info("node 1: joined run r at 127.0.0.1:1")
        logging.getLogger("multigpu.supervisor.exits").warning("warning: 100% of it")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert result.stderr == "multigpu: node 1: joined run r at 127.0.0.1:1\nmultigpu: warning: 100% of it\n"


def test_an_applications_own_logging_shows_each_line_once_in_its_format() -> None:
    result = run_python(
        """
        import logging
        logging.basicConfig(format="%(levelname)s|%(name)s|%(message)s")
        import multigpu.console.log
        logging.getLogger("multigpu.otx.manager").info("run r: 2 CPU worker(s)")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "INFO|multigpu.otx.manager|run r: 2 CPU worker(s)\n"


def test_a_level_the_application_set_first_stands_and_a_reload_adds_no_second_handler() -> None:
    result = run_python(
        """
        import importlib, logging
        logging.getLogger("multigpu").setLevel(logging.WARNING)
        import multigpu.console.log as log
        importlib.reload(log)
        logging.getLogger("multigpu.x").info("hidden")
        logging.getLogger("multigpu.x").warning("shown")
        print(len(logging.getLogger("multigpu").handlers))
        """
    )
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("1\n", "multigpu: shown\n")


def test_a_runs_lines_go_through_its_console_and_only_there(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(logging.root, "handlers", [])  # no application logging: the stand-in would print
    console = Collecting()
    with lines_through(console) as given:
        assert given is console
        logging.getLogger("multigpu.runner.attempts").info("attempt 0 failed")
    logging.getLogger("multigpu.runner.attempts").info("after the run")
    assert console.said == ["attempt 0 failed"]
    assert capsys.readouterr().err == "multigpu: after the run\n"
    assert [getattr(h, "runs", None) for h in PACKAGE.handlers] == [[]], "the run's console stays"


def test_a_handler_is_removed_when_the_run_raises() -> None:
    before = list(PACKAGE.handlers)
    with pytest.raises(RuntimeError), lines_through(Collecting()):
        raise RuntimeError("the run failed")
    assert PACKAGE.handlers == before


def test_lines_from_many_threads_reach_the_console_whole(capfd: pytest.CaptureFixture[str]) -> None:
    """The fate monitor's, the store's and the loop's threads log at once: every line arrives whole."""
    threads, lines = 8, 200

    def talk(t: int) -> None:
        for n in range(lines):
            logging.getLogger(f"multigpu.thread{t}").info(f"thread {t} line {n}")

    writer = ConsoleWriter()
    with lines_through(Console(writer)), writer:
        workers = [threading.Thread(target=talk, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    err = capfd.readouterr().err.splitlines()
    expected = {f"multigpu: thread {t} line {n}" for t in range(threads) for n in range(lines)}
    assert len(err) == len(expected) and set(err) == expected
    for t in range(threads):
        mine = [line for line in err if line.startswith(f"multigpu: thread {t} ")]
        assert mine == [f"multigpu: thread {t} line {n}" for n in range(lines)], (
            "each thread's lines in order"
        )


def test_a_handler_of_the_applications_that_filters_our_lines_out_does_not_hide_them() -> None:
    result = run_python(
        """
        import logging
        class NotOurs(logging.Filter):
            def filter(self, record):
                return not record.name.startswith("multigpu")
        handler = logging.StreamHandler()
        handler.addFilter(NotOurs())
        logging.basicConfig(handlers=[handler], format="APP %(message)s")
        import multigpu.console.log
        logging.getLogger("multigpu.supervisor.exits").warning("rank 1 failed")
        logging.getLogger("app").warning("the app's own line")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "multigpu: rank 1 failed\nAPP the app's own line\n"


def test_lines_logged_by_any_module_show_without_importing_the_console_first() -> None:
    result = run_python(
        """
        import logging
        import multigpu.rendezvous.elastic
        logging.getLogger("multigpu.rendezvous.elastic").info("round 2: nodes 0, 1")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "multigpu: round 2: nodes 0, 1\n"


def test_keep_enabled_undoes_dict_configs_disabling_of_our_loggers() -> None:
    result = run_python(
        """
        import logging, logging.config
        import multigpu.runner.static_join
        from multigpu.console.log import keep_enabled
        logging.config.dictConfig({"version": 1})
        logging.getLogger("multigpu.runner.static_join").info("lost")
        keep_enabled()
        logging.getLogger("multigpu.runner.static_join").info("node 0: joined")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "multigpu: node 0: joined\n"


def test_a_thread_logging_while_runs_begin_and_end_prints_each_line_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's console is swapped inside the one handler, under its lock: no line lost or doubled."""
    monkeypatch.setattr(logging.root, "handlers", [])
    console, stop, count = Collecting(), threading.Event(), 5000

    def flip() -> None:
        while not stop.is_set():
            with lines_through(console):
                pass

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for n in range(count):
            logging.getLogger("multigpu.race").info(f"line {n}")
    finally:
        stop.set()
        flipper.join()
    on_stderr = [line for line in capsys.readouterr().err.splitlines() if line.startswith("multigpu: line ")]
    shown = sorted([*console.said, *(line.removeprefix("multigpu: ") for line in on_stderr)])
    assert shown == sorted(f"line {n}" for n in range(count))
