"""Docker restart steps, the pure parts and the Restarter with fakes: docker's own stderr in a failed step's error,
and a container docker had to SIGKILL after the step's ``--time`` said so in the step record (the real CLI and
daemon: tests/engine/test_docker.py)."""

from __future__ import annotations

from collections.abc import Sequence

from watchdog.act.restart import Restarter
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.restart_plan import docker_time_given, killed_note, output_said
from watchdog.host.docker_cli import kills_argv
from watchdog.host.run import RunResult

NO_DAEMON = ("Cannot connect to the Docker daemon at unix:///tmp/x/nobody.sock. Is the docker daemon running?\n")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Docker:
    """A fake runner: each docker stop/restart takes ``took`` s and answers ``rc``/``output``; `docker events`
    answers ``signals`` (None: it fails)."""

    def __init__(self, clock: Clock, took: float, rc: int = 0, output: str = "", signals: str | None = "") -> None:
        self.clock, self.took, self.rc, self.output, self.signals = clock, took, rc, output, signals
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        self.calls.append(tuple(argv))
        if argv[1] == "events":
            self.clock.now += 0.1
            if self.signals is None:
                return RunResult(tuple(argv), 1, 0.1, output="Cannot connect", error="exit status 1")
            return RunResult(tuple(argv), 0, 0.1, output=self.signals)
        self.clock.now += self.took
        return RunResult(tuple(argv), self.rc, self.took, output=self.output,
                         error="" if self.rc == 0 else f"exit status {self.rc}")


def run(step: StepSection, runner: Docker, clock: Clock, node: str = "local") -> tuple[object, list[dict[str, object]]]:
    r = Restarter(RestartSection(steps=(step,)), {node: runner}, clock=clock, wall=clock)
    outcome = r.run()
    return outcome, [s for s in outcome.steps if s["what"] != "shm check"]


def test_docker_time_given_reads_stop_and_restart_only() -> None:
    assert docker_time_given(("docker", "stop", "--time", "8", "c")) == 8
    assert docker_time_given(("docker", "restart", "--time", "54", "c")) == 54
    assert docker_time_given(("docker", "start", "c")) is None
    assert docker_time_given(("systemctl", "stop", "--time", "8", "c")) is None
    argv = kills_argv("vllm", 100.0, 110.5)
    assert argv[:2] == ("docker", "events") and "container=vllm" in argv and "event=kill" in argv
    assert argv[argv.index("--until") + 1] == "110.500"


def test_killed_note_from_docker_events_or_the_time_taken() -> None:
    assert killed_note("stop", 8, 3.0, None) == ""  # stopped on SIGTERM, well within its time
    assert killed_note("stop", 8, 8.2, "15\n9\n") == "not stopped within 8s of SIGTERM: docker killed it (SIGKILL)"
    assert killed_note("restart", 8, 8.6, "15\n") == ""  # a graceful stop (7.9 s) and the start: not killed
    assert "docker killed it" in killed_note("stop", 8, 8.1, None)  # events not readable: a stop that took it all
    assert "may have" in killed_note("restart", 8, 8.6, None)  # a restart cannot be told without them


def test_output_said_keeps_the_last_lines_on_one_line() -> None:
    assert output_said("") == ""
    assert output_said("a\n\nb\nc\nError response from daemon: No such container: x\n") == \
        "b | c | Error response from daemon: No such container: x"
    assert len(output_said("x" * 1000)) == 300
    assert output_said("Flag --time has been deprecated, use --timeout instead\nError response from daemon: x\n") \
        == "Error response from daemon: x"


def test_a_failed_docker_step_says_dockers_own_reason() -> None:
    clock = Clock()
    runner = Docker(clock, 0.1, rc=1, output=NO_DAEMON)
    outcome, steps = run(StepSection(kind="docker", containers=("vllm",), timeout=60), runner, clock)
    assert not outcome.ok and outcome.failed == "docker restart vllm"  # type: ignore[attr-defined]
    error = outcome.results[-1].error  # type: ignore[attr-defined]
    assert error == "exit status 1: " + NO_DAEMON.strip(), error
    assert steps[0]["error"] == error and "killed" not in steps[0]


def test_a_container_that_did_not_stop_in_time_is_said_killed() -> None:
    clock = Clock()
    runner = Docker(clock, 8.3, signals="15\n9\n")
    outcome, steps = run(StepSection(kind="docker", action="stop", containers=("vllm",), timeout=10), runner, clock)
    assert outcome.ok  # type: ignore[attr-defined]
    assert runner.calls[0] == ("docker", "stop", "--time", "8", "vllm")
    events = runner.calls[1]
    assert events[:2] == ("docker", "events")
    since, until = float(events[events.index("--since") + 1]), float(events[events.index("--until") + 1])
    assert since <= 1000.0 and until >= 1008.3  # the whole stop, from before it began to after it ended
    assert steps[0]["killed"] == "not stopped within 8s of SIGTERM: docker killed it (SIGKILL)"
    assert steps[0]["ok"] is True


def test_a_quick_stop_asks_nothing_more_and_says_nothing() -> None:
    clock = Clock()
    runner = Docker(clock, 0.4)
    _, steps = run(StepSection(kind="docker", action="stop", containers=("vllm",), timeout=10), runner, clock)
    assert len(runner.calls) == 1 and "killed" not in steps[0]


def test_on_another_node_the_time_taken_tells_a_stop() -> None:
    clock = Clock()
    runner = Docker(clock, 8.3)
    _, steps = run(StepSection(kind="docker", action="stop", containers=("vllm",), timeout=10, node="w1"), runner,
                   clock, node="w1")
    assert len(runner.calls) == 1  # its agent runs only its steps: no docker events there
    assert "docker killed it" in str(steps[0]["killed"])
