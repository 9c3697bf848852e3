"""Command steps run as a transient service (``transient_unit``): the planner's systemctl/systemd-run argv, the
config loader's checks (each error names the key), the Restarter's "not loaded" stop, and a node's agent allowing
the same commands. Run for real under a throwaway systemd: tests/engine/test_shipped_unit.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from watchdog.act.restart import Restarter, RestartOutcome, ShmReport
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.load import Config, ConfigError, load
from watchdog.config.restart_plan import describe, plan
from watchdog.host.run import RunResult
from watchdog.nodes.agent_config import load_agent_config

ENGINE = ("/opt/vllm/bin/vllm", "serve", "/models/llama", "--port", "8000")
STOP = ("systemctl", "--no-ask-password", "stop", "--", "vllm-engine.service")


def run_as(unit: str = "vllm-engine.service", timeout: float = 300.0, action: str = "",
           unit_properties: tuple[str, ...] = ()) -> StepSection:
    return StepSection(kind="command", argv=ENGINE, transient_unit=unit, timeout=timeout, action=action,
                       unit_properties=unit_properties)


# --- the plan


def test_a_transient_step_stops_its_unit_then_starts_argv_as_it_through_systemd_run() -> None:
    commands = plan(RestartSection(steps=(run_as(unit_properties=("User=vllm", "EnvironmentFile=/etc/vllm/env")),)))
    assert [c.argv for c in commands] == [
        STOP,
        ("systemd-run", "--no-ask-password", "--unit=vllm-engine.service", "--collect", "--service-type=exec",
         "--property=TimeoutStopSec=285", "--property=User=vllm", "--property=EnvironmentFile=/etc/vllm/env",
         "--", *ENGINE),
    ]
    assert [(c.starts, c.not_loaded_ok, c.timeout, c.step) for c in commands] == [(False, True, 300.0, 0),
                                                                                (True, False, 300.0, 0)]
    assert describe(RestartSection(steps=(run_as(),)))[1].startswith(
        "command /opt/vllm/bin/vllm as vllm-engine.service (node local, up to 300s): systemd-run ")


def test_action_start_only_starts_and_the_stop_margin_follows_the_step_timeout() -> None:
    (start,) = plan(RestartSection(steps=(run_as(action="start", timeout=60.0),)))
    assert start.argv[:6] == ("systemd-run", "--no-ask-password", "--unit=vllm-engine.service", "--collect",
                              "--service-type=exec", "--property=TimeoutStopSec=54")
    assert start.argv[-len(ENGINE) - 1:] == ("--", *ENGINE) and start.starts


def test_a_plain_command_step_is_still_its_argv_as_written() -> None:
    (cmd,) = plan(RestartSection(steps=(StepSection(kind="command", argv=ENGINE),)))
    assert cmd.argv == ENGINE and not cmd.not_loaded_ok


def test_the_hook_and_the_shm_check_fall_between_the_stop_and_the_start() -> None:
    section = RestartSection(steps=(run_as(),), pre_start=("/usr/bin/true",))
    sweeps: list[str] = []
    seen: list[tuple[str, ...]] = []

    def runner(argv: Sequence[str], timeout: float) -> RunResult:
        seen.append(tuple(argv))
        return RunResult(tuple(argv), 0, 0.1)

    def sweep() -> ShmReport:
        sweeps.append(f"after {len(seen)} commands")
        return ShmReport("local")

    outcome = Restarter(section, {"local": runner}, sweepers={"local": sweep}).run()
    assert outcome.ok and [a[0] for a in seen] == ["systemctl", "/usr/bin/true", "systemd-run"]
    assert sweeps == ["after 1 commands"]  # the stopped engine's segments, before anything starts


# --- running it: systemctl's "not loaded" is nothing to stop, any other failure stops the restart


def restart_with(rcs: Sequence[int]) -> tuple[list[tuple[str, ...]], RestartOutcome]:
    calls: list[tuple[str, ...]] = []
    answers = list(rcs)

    def runner(argv: Sequence[str], timeout: float) -> RunResult:
        calls.append(tuple(argv))
        rc = answers.pop(0)
        out = "Failed to stop vllm-engine.service: Unit vllm-engine.service not loaded." if rc == 5 else "boom"
        return RunResult(tuple(argv), rc, 0.1, output=out, error="" if rc == 0 else f"exit status {rc}")

    return calls, Restarter(RestartSection(steps=(run_as(),)), {"local": runner}).run()


def test_a_unit_that_is_not_loaded_has_nothing_to_stop_and_the_start_goes_on() -> None:
    calls, outcome = restart_with([5, 0])
    assert [c[0] for c in calls] == ["systemctl", "systemd-run"]
    assert outcome.ok and outcome.steps[0]["ok"] and outcome.steps[0]["rc"] == 5
    assert outcome.steps[0]["note"] == "not loaded: nothing ran as it" and not outcome.steps[0]["error"]


def test_a_stop_that_fails_otherwise_stops_the_restart_with_systemctls_words() -> None:
    calls, outcome = restart_with([1])
    assert len(calls) == 1 and not outcome.ok
    assert outcome.steps[0]["error"] == "exit status 1: boom"


def test_exit_5_from_systemd_run_itself_is_a_failure() -> None:
    _, outcome = restart_with([0, 5])
    assert not outcome.ok and outcome.failed == "command /opt/vllm/bin/vllm as vllm-engine.service"


# --- the config: each key checked, the error names it


def load_step(tmp_path: Path, step: str) -> Config:
    path = tmp_path / "config.toml"
    path.write_text('[[restart.steps]]\nkind = "command"\nargv = ["/opt/vllm/bin/vllm", "serve"]\n' + step)
    return load(path)


def test_a_transient_step_loads_with_its_properties(tmp_path: Path) -> None:
    cfg = load_step(tmp_path, 'transient_unit = "vllm-engine.service"\nunit_properties = ["User=vllm"]\n')
    (step,) = cfg.restart.steps
    assert (step.transient_unit, step.unit_properties, step.verb) == ("vllm-engine.service", ("User=vllm",), "restart")


@pytest.mark.parametrize(("step", "problem"), [
    ('transient_unit = "vllm engine"\n', "restart.steps[0].transient_unit: 'vllm engine' is not a service name"),
    ('transient_unit = "vllm-engine"\n', "restart.steps[0].transient_unit: 'vllm-engine' is not a service name"),
    ('transient_unit = "vllm.service\\n"\n', "restart.steps[0].transient_unit:"),
    ('transient_unit = "engine-watchdog.service"\n', "restart.steps[0].transient_unit: 'engine-watchdog.service'"),
    ('transient_unit = "e.service"\naction = "stop"\n', "restart.steps[0].action: a step with transient_unit starts"),
    ('transient_unit = "e.service"\naction = "run"\n', "restart.steps[0].action: a step with transient_unit starts"),
    ('unit_properties = ["User=vllm"]\n', "restart.steps[0].unit_properties: only with transient_unit"),
    ('transient_unit = "e.service"\nunit_properties = ["user vllm"]\n', "restart.steps[0].unit_properties[0]: "),
    ('transient_unit = "e.service"\nunit_properties = ["User=a\\nExecStart=/bin/sh"]\n',
     "restart.steps[0].unit_properties[0]: "),
    ('transient_unit = "e.service"\nunit_properties = "User=vllm"\n',
     "restart.steps[0].unit_properties: expected a list of strings"),
    ('transient_unit = ["e.service"]\n', "restart.steps[0].transient_unit: expected a string"),
    ('transient_units = "e.service"\n', "unknown key restart.steps[0].transient_units"),
])
def test_bad_transient_keys_are_refused_naming_the_key(tmp_path: Path, step: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_step(tmp_path, step)
    assert problem in str(err.value)


def test_only_a_command_step_runs_as_a_transient_unit(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[[restart.steps]]\nkind = "systemd"\nunits = ["vllm.service"]\ntransient_unit = "e.service"\n')
    with pytest.raises(ConfigError, match=r"restart\.steps\[0\]\.transient_unit: only a command step"):
        load(path)


def test_a_nodes_agent_allows_the_transient_commands_its_own_step_plans(tmp_path: Path) -> None:
    agent = tmp_path / "agent.toml"
    agent.write_text('engine_users = []\n[[steps]]\nkind = "command"\nargv = ["/opt/vllm/bin/vllm", "serve"]\n'
                     'transient_unit = "vllm-worker.service"\n')
    cfg = load_agent_config(str(agent))
    start = ("systemd-run", "--no-ask-password", "--unit=vllm-worker.service", "--collect", "--service-type=exec",
             "--property=TimeoutStopSec=285", "--", "/opt/vllm/bin/vllm", "serve")
    assert cfg.allowed() == {("systemctl", "--no-ask-password", "stop", "--", "vllm-worker.service"), start}
    assert cfg.permits((*start[:-1], "other")) is None
    agent.write_text('[[steps]]\nkind = "command"\nargv = ["/x"]\ntransient_unit = "x"\n')
    with pytest.raises(ConfigError, match=r"steps\[0\]\.transient_unit: 'x' is not a service name"):
        load_agent_config(str(agent))
