"""Restart: the plan (order, pre-start hook, docker --time), the Restarter with a fake runner and fake clock,
and LocalRunner for real (exit codes, missing programs, timeouts that end the whole process group)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.facts import says
from tests.fakes import is_gone, read_pids
from watchdog.act.restart import Restarter
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.restart_plan import describe, docker_stop_time, plan
from watchdog.host.run import OUTPUT_TAIL_BYTES, LocalRunner, RunResult

SYSTEMCTL = ("systemctl", "--no-ask-password")


def mixed_stack(pre_start: tuple[str, ...] = ()) -> RestartSection:
    steps = (StepSection(kind="systemd", action="stop", units=("a.service", "b.service"), timeout=100),
             StepSection(kind="docker", action="restart", containers=("c",), timeout=60),
             StepSection(kind="command", argv=("/opt/restart.sh", "--all"), timeout=30))
    return RestartSection(steps=steps, pre_start=pre_start)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Records (argv, timeout); each call takes ``took`` seconds of the fake clock and exits with the next rc."""

    def __init__(self, clock: FakeClock, rcs: Sequence[int] = (), took: float = 1.0,
                 on_call: Callable[[], None] | None = None) -> None:
        self.clock, self.rcs, self.took, self.on_call = clock, list(rcs), took, on_call
        self.calls: list[tuple[tuple[str, ...], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        self.calls.append((tuple(argv), timeout))
        self.clock.now += self.took
        if self.on_call is not None:
            self.on_call()
        rc = self.rcs.pop(0) if self.rcs else 0
        return RunResult(tuple(argv), rc, self.took, error="" if rc == 0 else f"exit status {rc}")

    @property
    def argvs(self) -> list[tuple[str, ...]]:
        return [argv for argv, _ in self.calls]


def restarter(section: RestartSection, rcs: Sequence[int] = (), took: float = 1.0,
              on_call: Callable[[], None] | None = None) -> tuple[Restarter, FakeRunner]:
    clock = FakeClock()
    runner = FakeRunner(clock, rcs, took, on_call)
    return Restarter(section, {"local": runner}, clock=clock), runner


# --- the plan


def test_plan_runs_one_unit_and_container_at_a_time_in_the_order_written() -> None:
    commands = plan(mixed_stack())
    assert [c.argv for c in commands] == [
        (*SYSTEMCTL, "stop", "--", "a.service"),
        (*SYSTEMCTL, "stop", "--", "b.service"),
        ("docker", "restart", "--time", "54", "c"),
        ("/opt/restart.sh", "--all"),
    ]
    assert [c.description for c in commands] == ["systemd stop a.service", "systemd stop b.service",
                                                 "docker restart c", "command /opt/restart.sh"]
    assert [(c.step, c.timeout, c.node) for c in commands] == [(0, 100, "local"), (0, 100, "local"),
                                                               (1, 60, "local"), (2, 30, "local")]


def test_pre_start_hook_goes_before_the_first_systemd_or_docker_start_even_after_a_command() -> None:
    steps = (StepSection(kind="command", argv=("/bin/drain",)),
             StepSection(kind="systemd", action="stop", units=("u",)),
             StepSection(kind="docker", action="start", containers=("c",)),
             StepSection(kind="systemd", action="restart", units=("v",)))
    commands = plan(RestartSection(steps=steps, pre_start=("/bin/drop-caches", "3"), pre_start_timeout=7))
    assert [c.description for c in commands] == ["command /bin/drain", "systemd stop u", "pre-start hook",
                                                 "docker start c", "systemd restart v"]
    hook = commands[2]
    assert (hook.step, hook.argv, hook.timeout) == (None, ("/bin/drop-caches", "3"), 7)


def test_pre_start_hook_without_a_start_step_goes_before_the_first_command() -> None:
    steps = (StepSection(kind="systemd", action="stop", units=("u",)),
             StepSection(kind="command", argv=("/opt/up.sh",)),
             StepSection(kind="command", argv=("/opt/check.sh",)))
    commands = plan(RestartSection(steps=steps, pre_start=("/bin/hook",)))
    assert [c.description for c in commands] == ["systemd stop u", "pre-start hook", "command /opt/up.sh",
                                                 "command /opt/check.sh"]


def test_no_pre_start_hook_for_stop_steps_only_or_when_unset() -> None:
    stop_only = (StepSection(kind="docker", action="stop", containers=("c",)),)
    assert [c.description for c in plan(RestartSection(steps=stop_only, pre_start=("/bin/hook",)))] == \
        ["docker stop c"]
    assert all(c.step is not None for c in plan(mixed_stack()))


def test_docker_stop_time_leaves_a_margin_and_is_at_least_one_second() -> None:
    assert docker_stop_time(300) == 285
    assert docker_stop_time(60) == 54
    assert docker_stop_time(10) == 8
    assert docker_stop_time(2) == 1
    assert docker_stop_time(0.5) == 1
    start = plan(RestartSection(steps=(StepSection(kind="docker", action="start", containers=("c",)),)))
    assert start[0].argv == ("docker", "start", "c")
    stop = plan(RestartSection(steps=(StepSection(kind="docker", action="stop", containers=("c",), timeout=300),)))
    assert stop[0].argv == ("docker", "stop", "--time", "285", "c")


def test_describe_quotes_each_argv_for_display() -> None:
    section = RestartSection(steps=(StepSection(kind="command", argv=("/opt/my restart.sh", "a b"), timeout=5),
                                    StepSection(kind="systemd", units=("vllm-head.service",))))
    assert describe(section) == [
        "command /opt/my restart.sh (node local, up to 5s): '/opt/my restart.sh' 'a b'",
        "systemd restart vllm-head.service (node local, up to 300s): "
        "systemctl --no-ask-password restart -- vllm-head.service",
    ]


# --- the Restarter


def test_restarter_runs_every_command_in_order_and_logs_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    r, runner = restarter(mixed_stack(pre_start=("/bin/hook",)), took=2.0)
    with caplog.at_level(logging.INFO, logger="watchdog.act.restart"):
        outcome = r.run()
    assert outcome.ok and outcome.failed == "" and not outcome.cancelled
    assert runner.argvs == [c.argv for c in plan(mixed_stack(pre_start=("/bin/hook",)))]
    assert runner.argvs[2] == ("/bin/hook",)
    assert len(outcome.results) == 5 and outcome.duration == pytest.approx(10.0)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "watchdog.act.restart"]
    assert says(lines[0], "systemd stop a.service", "ok", "rc 0", "2.0s") and len(lines) == 5


def test_restarter_stops_at_the_first_failure_even_a_stop() -> None:
    r, runner = restarter(mixed_stack(), rcs=[0, 5])
    outcome = r.run()
    assert not outcome.ok
    assert outcome.failed == "systemd stop b.service"
    assert len(runner.calls) == 2 and [x.rc for x in outcome.results] == [0, 5]
    assert outcome.results[-1].error == "exit status 5"


def test_failed_pre_start_hook_stops_the_start() -> None:
    r, runner = restarter(mixed_stack(pre_start=("/bin/hook",)), rcs=[0, 0, 1])
    outcome = r.run()
    assert outcome.failed == "pre-start hook" and len(runner.calls) == 3


def test_commands_of_a_step_share_its_timeout() -> None:
    steps = (StepSection(kind="systemd", action="stop", units=("a", "b", "c"), timeout=100),
             StepSection(kind="command", argv=("/bin/next",), timeout=50))
    r, runner = restarter(RestartSection(steps=steps), took=30.0)
    assert r.run().ok
    assert [t for _, t in runner.calls] == [100, 70, 40, 50]  # a new step starts with its full timeout


def test_a_step_whose_time_is_used_up_fails_without_running_its_next_command() -> None:
    steps = (StepSection(kind="systemd", action="stop", units=("a", "b", "c"), timeout=100),)
    r, runner = restarter(RestartSection(steps=steps), took=60.0)
    outcome = r.run()
    assert [t for _, t in runner.calls] == [100, 40]
    assert outcome.failed == "systemd stop c"
    last = outcome.results[-1]
    assert last.timed_out and last.rc is None and "used up" in last.error


def test_docker_time_shrinks_to_the_time_left_in_the_step() -> None:
    steps = (StepSection(kind="docker", action="stop", containers=("c1", "c2"), timeout=100),)
    r, runner = restarter(RestartSection(steps=steps), took=60.0)
    assert r.run().ok
    stops = [a for a in runner.argvs if a[1] != "events"]  # c2 took its whole --time: docker's events asked
    assert stops == [("docker", "stop", "--time", "90", "c1"), ("docker", "stop", "--time", "36", "c2")]


def test_cancel_stops_before_the_next_command() -> None:
    cancel = threading.Event()
    r, runner = restarter(mixed_stack(), on_call=cancel.set)
    outcome = r.run(cancel)
    assert len(runner.calls) == 1
    assert not outcome.ok and outcome.cancelled and outcome.failed == "systemd stop b.service"


def test_no_steps_is_an_error_not_a_success() -> None:
    with pytest.raises(ValueError, match="no restart steps configured"):
        Restarter(RestartSection(), {"local": FakeRunner(FakeClock())}).run()


def test_a_node_without_a_runner_is_named() -> None:
    with pytest.raises(ValueError, match=r"no runner for node 'local' \(systemd stop a.service\); runners: gpu2"):
        Restarter(mixed_stack(), {"gpu2": FakeRunner(FakeClock())})


# --- LocalRunner (watchdog.host.run), for real


def test_local_runner_true_and_exit_status() -> None:
    ok = LocalRunner()(["/bin/true"], 10)
    assert ok.ok and ok.rc == 0 and ok.error == "" and not ok.timed_out
    failed = LocalRunner()(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], 10)
    assert not failed.ok and failed.rc == 3 and failed.error == "exit status 3"
    assert failed.argv == ("/bin/sh", "-c", "echo out; echo err >&2; exit 3")
    assert "out\n" in failed.output and "err\n" in failed.output


def test_local_runner_names_a_signal_that_killed_the_command() -> None:
    result = LocalRunner()(["/bin/sh", "-c", "kill -9 $$"], 10)
    assert result.rc == -9 and result.error == "killed by SIGKILL"


def test_local_runner_missing_or_unrunnable_program_is_a_result_not_an_exception(tmp_path: Path) -> None:
    missing = LocalRunner()(["no-such-program-for-the-watchdog"], 10)
    assert missing.rc is None and says(missing.error, "not found", "no-such-program-for-the-watchdog")
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    denied = LocalRunner()([str(script)], 10)
    assert denied.rc is None and says(denied.error, "permission denied", script) and not denied.ok


def test_local_runner_output_tail_is_bounded() -> None:
    result = LocalRunner()(["/bin/sh", "-c", "head -c 100000 /dev/zero | tr '\\0' a; echo; echo END"], 10)
    assert result.ok
    assert len(result.output) <= OUTPUT_TAIL_BYTES and result.output.endswith("a\nEND\n")


def test_local_runner_timeout_ends_the_child_and_its_grandchildren(tmp_path: Path, groups: list[int]) -> None:
    pid_file = tmp_path / "pids"
    script = 'sleep 60 & echo "$$ $!" > "$1"; sleep 60'
    result = LocalRunner(kill_grace=2.0)(["/bin/sh", "-c", script, "sh", str(pid_file)], 1.0)
    child, grandchild = read_pids(pid_file)
    groups.append(child)  # the group, should the runner have failed to end it
    assert result.timed_out and result.rc is None and not result.ok
    assert says(result.error, "timed out", "1s")
    assert 0.9 <= result.duration < 10  # the timeout plus at most the grace, with room for a slow machine
    assert is_gone(grandchild) and is_gone(child)


def test_local_runner_does_not_wait_for_a_grandchild_holding_its_output(tmp_path: Path,
                                                                       groups: list[int]) -> None:
    pid_file = tmp_path / "pids"
    script = 'sleep 60 & echo "$$ $!" > "$1"; echo started'
    started = time.monotonic()
    result = LocalRunner()(["/bin/sh", "-c", script, "sh", str(pid_file)], 30)
    elapsed = time.monotonic() - started
    child, grandchild = read_pids(pid_file)
    groups.append(child)  # the grandchild is still in the child's process group
    assert result.ok and result.output == "started\n"
    assert elapsed < 20  # well below the grandchild's 60 s: run() did not wait for it
    os.kill(grandchild, 0)  # still running: a command that exited normally keeps what it started
