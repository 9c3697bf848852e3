"""The act stage's incident lifecycle, with hand-written fakes for the clock, the alerts and the recovery."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.facts import says
from watchdog.act.alerts import Alert
from watchdog.act.incident_types import Incident, Kind, Memory, Phase, RecoveryJob
from watchdog.act.respond import CONTROL_CALM_EVERY, Responder
from watchdog.act.restart import Progress, RecoveryDone
from watchdog.act.state import Control, save_control, save_memory
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.load import Config, load
from watchdog.core.types import State, Verdict

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.wall = T0

    def __call__(self) -> float:
        return self.wall


class FakeRecovery:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.jobs: list[RecoveryJob] = []
        self.phase_on_disk: list[str] = []
        self.done: RecoveryDone | None = None
        self.progress: Progress | None = None

    @property
    def busy(self) -> bool:
        return bool(self.jobs) and self.done is None

    def start(self, job: RecoveryJob) -> None:
        self.jobs.append(job)
        memory = json.loads((self.state_dir / "recovery.json").read_text())
        self.phase_on_disk.append(memory["incident"]["phase"])  # saved before acting

    def finish(self, ok: bool, at: float, detail: str = "one token generated in 0.10s", stage: str = "ready") -> None:
        self.done = RecoveryDone(self.jobs[-1], ok, stage, detail, at if ok else None, 5.0)

    def poll(self) -> RecoveryDone | None:
        done, self.done = self.done, None
        return done


class Harness:
    def __init__(self, tmp: Path, cfg: Config) -> None:
        self.tmp, self.clock = tmp, Clock()
        self.alerts: list[Alert] = []
        self.events: list[dict[str, Any]] = []
        self.recovery = FakeRecovery(tmp)
        self.r = Responder(cfg, tmp, self, self.recovery, self.events.append, ["command /bin/restart"], self.clock)
        self.mono = 1000.0

    def submit(self, alert: Alert) -> None:
        self.alerts.append(alert)

    def step(self, state: State, since_ago: float = 0.0, reason: str = "", advance: float = 1.0,
             stacks_only: bool = False) -> None:
        self.clock.wall += advance
        self.mono += advance
        v = Verdict("0", state, reason or f"{state.value} for the test", self.mono - since_ago, self.mono,
                    last_progress=self.mono if state == State.WORKING else None, stacks_only=stacks_only)
        self.r.step([v], self.mono)

    def names(self) -> list[str]:
        return [e["event"] for e in self.events]

    def sent(self) -> list[str]:
        return [a.event for a in self.alerts]


def config(**restart: Any) -> Config:
    steps = (StepSection(kind="command", argv=("/bin/restart",)),)
    base = RestartSection(steps=steps, evidence_timeout=60.0, hold_max=300.0, down_after=10.0, boot_timeout=600.0,
                          backoff_initial=60.0, backoff_max=600.0, budget=2)
    import dataclasses
    return dataclasses.replace(Config(), restart=dataclasses.replace(base, **restart))


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path, config())


def test_freeze_waits_for_its_stacks_then_restarts_with_state_on_disk_first(h: Harness) -> None:
    h.step(State.WORKING)
    h.step(State.FROZEN)
    assert h.names() == ["incident_opened"] and h.sent() == ["stall_detected"]
    h.step(State.FROZEN)
    assert h.recovery.jobs == []  # evidence first
    h.r.evidence("0", "stuck", "/var/lib/x/incidents/b1", {"culprit": "Worker_TP1"})
    h.step(State.FROZEN)
    assert h.sent() == ["stall_detected", "evidence_captured", "restart_started"]
    assert h.alerts[1].details["bundle"] == "/var/lib/x/incidents/b1" and h.alerts[1].details["verdict"] == "stuck"
    [job] = h.recovery.jobs
    assert job.restart and job.timeout == 600.0 and h.recovery.phase_on_disk == ["restarting"]
    started = h.events[-1]
    assert started["event"] == "restart_started" and started["plan"] == ["command /bin/restart"]
    # judgement of the stack is paused while the recovery runs: a down or frozen verdict changes nothing
    h.step(State.DOWN)
    h.step(State.FROZEN)
    assert len(h.recovery.jobs) == 1 and h.names().count("incident_opened") == 1
    assert h.r.status(h.clock.wall)["incident"]["phase"] == "restarting"
    h.recovery.progress = Progress(Phase.PROVING, h.clock.wall)  # the steps are done
    h.step(State.STARTING)
    assert h.r.status(h.clock.wall)["incident"]["phase"] == "proving"
    assert json.loads((h.tmp / "recovery.json").read_text())["incident"]["phase"] == "proving"
    h.recovery.finish(True, h.clock.wall + 1)
    h.step(State.STARTING)
    assert h.sent()[-2:] == ["recovered", "resolved"] and h.alerts[-1].resolved
    assert [a.state for a in h.alerts] == ["frozen", "frozen", "restarting", "serving", "serving"]
    assert h.alerts[-2].details["downtime"] == pytest.approx(h.clock.wall - T0 - 2 + 1 - 1, abs=2)
    assert h.r.memory.incident is None and len({a.incident_id for a in h.alerts}) == 1


def test_without_stacks_in_time_the_restart_goes_ahead(h: Harness) -> None:
    h.step(State.FROZEN)
    h.step(State.FROZEN, advance=59)
    assert h.recovery.jobs == []
    h.step(State.FROZEN, advance=2)
    assert len(h.recovery.jobs) == 1 and "evidence_captured" not in h.sent()


def test_failed_capture_restarts_at_once(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", None, None, {"error": "py-spy not found"})
    h.step(State.FROZEN)
    assert len(h.recovery.jobs) == 1
    assert h.alerts[1].event == "evidence_captured" and h.alerts[1].details["error"] == "py-spy not found"


def test_stacks_that_show_work_hold_the_restart_then_hold_max_ends_it(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", "working", "/b", {})
    h.step(State.FROZEN)
    assert h.recovery.jobs == [] and "restart_held" in h.names()
    h.step(State.FROZEN, advance=100)
    assert h.names().count("restart_held") == 1  # said once
    h.step(State.FROZEN, advance=250)
    assert "hold_ended" in h.names() and len(h.recovery.jobs) == 1


def test_an_incident_that_clears_by_itself_is_resolved_without_a_restart(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.WORKING)
    assert h.recovery.jobs == [] and h.sent() == ["stall_detected", "evidence_captured", "resolved"]
    assert says(h.events[-1]["how"], "serves", "without a restart"), h.events[-1]


def test_stacks_alone_do_not_clear_an_incident_and_suspect_does_not_confirm_it(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.WORKING, reason="a long step: the stacks show work: compiling", stacks_only=True)
    h.step(State.SUSPECT)
    assert h.recovery.jobs == [] and "resolved" not in h.sent()
    h.step(State.FROZEN)
    assert len(h.recovery.jobs) == 1  # confirmed frozen again: now it acts


def test_down_needs_down_after_and_a_supervisor_is_waited_for(tmp_path: Path) -> None:
    h = Harness(tmp_path, config(supervised=True))
    h.step(State.DOWN, since_ago=5)
    assert h.events == []
    h.step(State.DOWN, since_ago=11)
    assert h.sent() == ["engine_down"] and h.alerts[0].details["kind"] == "down"
    [job] = h.recovery.jobs
    assert not job.restart and "awaiting_supervisor" in h.names()
    h.recovery.finish(True, h.clock.wall)
    h.step(State.IDLE)
    assert h.sent() == ["engine_down", "recovered", "resolved"]


def test_a_start_longer_than_the_boot_timeout_is_an_incident(h: Harness) -> None:
    h.step(State.STARTING, since_ago=599)
    assert h.events == []
    h.step(State.STARTING, since_ago=601)
    assert h.sent() == ["stall_detected", "restart_started"] and h.alerts[0].details["kind"] == "boot_timeout"


def test_failed_restarts_back_off_then_spend_the_budget_and_give_up_once(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    h.recovery.finish(False, 0, "not serving by the boot timeout")
    h.step(State.FROZEN)
    assert h.sent()[-1] == "restart_failed" and "backoff" in h.events[-1]["reason"]
    assert len(h.recovery.jobs) == 1
    h.step(State.FROZEN, advance=61)
    assert len(h.recovery.jobs) == 2
    h.recovery.finish(False, 0, "steps failed", stage="steps")
    for _ in range(5):
        h.step(State.FROZEN, advance=200)
    assert len(h.recovery.jobs) == 2 and h.sent().count("gave_up") == 1
    assert h.r.memory.gave_up is not None
    status = h.r.status(h.clock.wall)
    assert status["budget_left"] == 0 and status["gave_up"]
    # a later incident stays observe-only until a reset
    h.recovery.done = None
    save_control(h.tmp, Control(reset_at=h.clock.wall + 1))
    h.step(State.FROZEN, advance=2)
    assert len(h.recovery.jobs) == 3


def test_a_watchdog_restarted_mid_recovery_waits_instead_of_restarting(tmp_path: Path) -> None:
    inc = Incident("i-7", "0", Kind.FROZEN, T0 - 100, phase=Phase.RESTARTING, attempts=1, restart_started=T0 - 50)
    save_memory(tmp_path, Memory((T0 - 50,), None, inc))
    h = Harness(tmp_path, config())
    h.r.resume()
    [job] = h.recovery.jobs
    assert not job.restart and job.incident == "i-7" and job.timeout == T0 - 50 + 600.0 - h.clock.wall
    assert h.names() == ["incident_resumed"]
    h.recovery.finish(True, h.clock.wall)
    h.step(State.IDLE)
    assert h.sent() == ["recovered", "resolved"] and all(a.incident_id == "i-7" for a in h.alerts)


def test_paused_opens_and_records_but_neither_acts_nor_alerts(h: Harness) -> None:
    save_control(h.tmp, Control(paused=True))
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    h.step(State.FROZEN)
    assert h.alerts == [] and h.recovery.jobs == []
    assert [e["alert"] for e in h.events if e["event"] == "alert_suppressed"] == ["stall_detected",
                                                                                 "evidence_captured"]
    assert [e["choice"] for e in h.events if e["event"] == "restart_not_run"] == ["paused"]
    save_control(h.tmp, Control(paused=False))
    h.step(State.FROZEN)
    assert len(h.recovery.jobs) == 1 and h.sent() == ["restart_started"]


def test_observe_only_without_steps(tmp_path: Path) -> None:
    h = Harness(tmp_path, load(None))
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    assert h.recovery.jobs == [] and h.events[-1]["choice"] == "observe"


def test_the_down_verdict_of_a_restart_does_not_open_a_new_incident_once_it_is_proven_back(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    h.step(State.DOWN, since_ago=0)
    down_since = h.mono
    h.clock.wall += 40
    h.mono += 40
    h.recovery.finish(True, h.clock.wall)
    # the pass that collects the proof still carries the restart's 40 s old down verdict
    h.r.step([Verdict("0", State.DOWN, "refused", down_since, h.mono)], h.mono)
    assert h.sent()[-2:] == ["recovered", "resolved"] and h.r.memory.incident is None
    h.step(State.DOWN, since_ago=41, advance=5)  # still the same verdict 5 s later: not yet down_after
    assert h.r.memory.incident is None
    h.step(State.DOWN, since_ago=52, advance=6)  # down for 11 s after the recovery: a new incident
    assert h.r.memory.incident is not None and h.sent()[-1] == "engine_down"


def test_a_failed_restart_still_starting_is_acted_on_again(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    h.recovery.finish(False, 0, "not serving by the boot timeout")
    h.step(State.STARTING, advance=61)
    h.step(State.STARTING, advance=1)
    assert len(h.recovery.jobs) == 2


def test_a_pause_taken_while_calm_holds_the_first_pass_in_trouble(h: Harness) -> None:
    h.step(State.WORKING)  # calm: the switches were read on this pass, then only every few seconds
    save_control(h.tmp, Control(paused=True))
    h.step(State.WORKING, advance=0.5)
    assert h.r.status(h.clock.wall)["paused"] is False  # calm and read 0.5 s ago: not looked at yet (that is fine)
    h.step(State.FROZEN, advance=0.5)  # trouble: read on this very pass, before anything is done
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    assert h.recovery.jobs == [] and h.alerts == []
    assert [e["choice"] for e in h.events if e["event"] == "restart_not_run"] == ["paused"]


def test_while_calm_the_switches_are_read_every_few_seconds(h: Harness) -> None:
    h.step(State.IDLE)
    save_control(h.tmp, Control(paused=True))
    seen = []
    for _ in range(int(CONTROL_CALM_EVERY) + 2):  # a pass a second
        h.step(State.IDLE)
        seen.append(h.r.status(h.clock.wall)["paused"])
    assert seen[0] is False and seen[-1] is True and seen.index(True) <= CONTROL_CALM_EVERY


def test_a_freeze_asks_for_its_bundle_with_its_incident_id_when_it_opens(tmp_path: Path) -> None:
    """The incident has its id from the moment it opens, and its bundle is asked for then, under that id: once per
    incident, never for a suspicion; a down engine's bundle too, and nothing with capture off."""
    asked: list[tuple[str, str, str]] = []
    h = Harness(tmp_path, config())
    h.r.bundle = lambda inc: asked.append((inc.kind.value, inc.engine, inc.id))
    h.step(State.SUSPECT)
    assert asked == []
    h.step(State.FROZEN)
    opened = h.events[-1]
    assert opened["event"] == "incident_opened" and asked == [("frozen", "0", opened["incident"])]
    h.step(State.FROZEN)
    assert len(asked) == 1
    h.step(State.IDLE)  # it clears: resolved; a later freeze is a new incident with its own id and bundle
    h.step(State.FROZEN)
    assert len(asked) == 2 and asked[1][2] != asked[0][2] and asked[1][2] == h.events[-1]["incident"]


def severities(h: Harness) -> list[tuple[str, str]]:
    return [(a.event, a.severity) for a in h.alerts]


def test_a_freeze_restarted_within_the_budget_is_a_warning_until_its_restart_fails(h: Harness) -> None:
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    assert severities(h) == [("stall_detected", "warning"), ("evidence_captured", "warning"),
                             ("restart_started", "warning")]
    assert h.r.status(h.clock.wall)["incident"]["in_hand"] is True
    h.recovery.finish(False, 0, "not serving by the boot timeout")
    h.step(State.FROZEN)
    assert severities(h)[-1] == ("restart_failed", "critical")  # the page
    h.step(State.FROZEN, advance=61)  # the second restart of the budget: still a page, the first one failed
    assert len(h.recovery.jobs) == 2 and h.r.status(h.clock.wall)["incident"]["in_hand"] is False
    assert json.loads((h.tmp / "recovery.json").read_text())["incident"]["in_hand"] is False


def test_a_freeze_nothing_will_restart_pages_at_once(tmp_path: Path) -> None:
    h = Harness(tmp_path, load(None))  # no restart steps: alert only
    h.step(State.FROZEN)
    assert severities(h) == [("stall_detected", "critical")]


def test_a_freeze_with_the_budget_spent_pages_and_its_give_up_too(tmp_path: Path) -> None:
    save_memory(tmp_path, Memory([T0 - 10], None, None))  # the one restart of the budget was spent just now
    h = Harness(tmp_path, config(budget=1))
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    assert severities(h) == [("stall_detected", "critical"), ("evidence_captured", "critical"),
                             ("gave_up", "critical")]


def test_a_freeze_opened_while_paused_is_still_in_hand_once_resumed(h: Harness) -> None:
    save_control(h.tmp, Control(paused=True))
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    h.step(State.FROZEN)
    save_control(h.tmp, Control(paused=False))
    h.step(State.FROZEN)
    assert severities(h) == [("restart_started", "warning")]
