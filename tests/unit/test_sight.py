"""Blind incidents (watchdog.act.incident_sight) through the responder, with fakes for the clock, the alerts and
the recovery: the page or a node unseen for blind_after is one incident of its own, alerted with its runbook, never
restarted, resolved when seen; a freeze here while a node is unseen says both."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from tests.facts import says
from watchdog.act.alerts import Alert
from watchdog.act.incident_types import RecoveryJob
from watchdog.act.respond import Responder
from watchdog.act.restart import Progress, RecoveryDone
from watchdog.act.state import Control, load_memory, save_control
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.load import Config, ConfigError, load
from watchdog.core.runbooks import Runbook, runbook_link
from watchdog.core.types import State, Verdict
from watchdog.nodes.liveness import NodeView, overlay, view
from watchdog.service.exporter import Exporter

T0 = 1_800_000_000.0
WHY = "ssh: connect to host 10.0.0.2 port 22: Connection timed out"
LOST = view("worker1", None, None, 6.0, WHY)
SEEN = NodeView("worker1", "ok", "2 rank(s) running on node worker1")


class FakeRecovery:
    def __init__(self) -> None:
        self.jobs: list[RecoveryJob] = []
        self.progress: Progress | None = None

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    def start(self, job: RecoveryJob) -> None:
        self.jobs.append(job)

    def poll(self) -> RecoveryDone | None:
        return None


class Stack:
    """One responder and its sight, stepped as the act stage steps them (`watchdog.service.daemon.Daemon._respond`)."""

    def __init__(self, tmp: Path, cfg: Config, mono: float = 1000.0, wall: float = T0) -> None:
        self.tmp, self.cfg = tmp, cfg
        self.wall, self.mono = wall, mono
        self.alerts: list[Alert] = []
        self.events: list[dict[str, Any]] = []
        self.recovery = FakeRecovery()
        self.r = Responder(cfg, tmp, self, self.recovery, self.events.append, ["command /bin/restart"],
                           lambda: self.wall)

    def submit(self, alert: Alert) -> None:
        self.alerts.append(alert)

    def step(self, state: State, views: list[NodeView], advance: float = 1.0, reason: str = "",
             stalled: float = 0.0) -> None:
        self.wall += advance
        self.mono += advance
        local = [Verdict("0", state, reason or f"{state.value} for the test", self.mono - stalled, self.mono,
                         stalled_for=stalled)]
        self.r.sight(local, views, self.mono)
        self.r.step(overlay(local, views), self.mono)

    def sent(self) -> list[str]:
        return [a.event for a in self.alerts]

    def status(self) -> dict[str, Any]:
        return {**self.r.status(self.wall), "blind": self.r.blind_status()}


def config(blind_after: float = 60.0) -> Config:
    steps = (StepSection(kind="command", argv=("/bin/restart",)),)
    c = Config()
    return dataclasses.replace(c, restart=RestartSection(steps=steps, evidence_timeout=30.0),
                               alerts=dataclasses.replace(c.alerts, blind_after=blind_after))


@pytest.fixture
def s(tmp_path: Path) -> Stack:
    return Stack(tmp_path, config())


def test_a_node_unseen_59s_is_quiet_61s_alerted_with_its_runbook_never_restarted_resolved_when_seen(s: Stack) -> None:
    s.step(State.IDLE, [SEEN])
    s.step(State.IDLE, [LOST])  # first pass unseen
    s.step(State.IDLE, [LOST], advance=59)
    assert s.sent() == [] and s.status()["blind"][0]["incident"] is None
    assert s.status()["blind"][0]["seconds"] == 59 and s.r.watching
    s.step(State.IDLE, [LOST], advance=2)
    [a] = s.alerts
    assert a.event == "blind" and not a.resolved and a.state == "blind"
    assert a.runbook == runbook_link(Runbook.BLIND_NODE)
    assert says(a.summary, "node worker1", "61s", "Connection timed out", "engine 0 is idle", "nothing is restarted")
    assert a.details["node"] == "worker1" and a.details["why"] == WHY and a.details["kind"] == "blind"
    assert a.details["frozen_here"] is False
    opened = [e for e in s.events if e["event"] == "incident_opened"]
    assert [(e["kind"], e["incident"]) for e in opened] == [("blind", a.incident_id)]
    assert "-blind-" in a.incident_id
    blind_now = s.status()["blind"]
    assert blind_now == [{"what": "node:worker1", "unseen": "node worker1", "why": WHY, "since": pytest.approx(T0 + 2),
                          "seconds": 61.0, "incident": a.incident_id, "engine": a.engine}]
    assert s.status()["incident"] is None  # the restart policy's incident: none
    for _ in range(5):
        s.step(State.IDLE, [LOST], advance=30)
    assert s.sent() == ["blind"] and s.recovery.jobs == [] and s.status()["budget_left"] == s.cfg.restart.budget
    s.step(State.IDLE, [SEEN])
    assert s.sent() == ["blind", "resolved"]
    done = s.alerts[-1]
    assert done.resolved and done.incident_id == a.incident_id and done.state == "idle"
    assert says(done.summary, "node worker1", "seen again", "212s")
    assert s.status()["blind"] == [] and not s.r.watching
    assert json.loads((s.tmp / "recovery.json").read_text())["blind"] == []
    assert [e["incident"] for e in s.events if e["event"] == "resolved"] == [a.incident_id]


def test_frozen_here_while_the_node_is_unseen_says_both_then_the_usual_path(s: Stack) -> None:
    """The worker node hangs whole: the head's engine stalls and freezes, the overlay calls it blind (no frozen
    incident, no restart); the blind alert says both; once the node is seen again the freeze is the usual incident."""
    s.step(State.WORKING, [SEEN])
    s.step(State.SUSPECT, [LOST], reason="no progress for 6s", stalled=6)
    for _ in range(6):
        s.step(State.FROZEN, [LOST], advance=10, reason="no progress for 45s with work pending (2 running)",
               stalled=45)
    [a] = s.alerts
    assert a.event == "blind" and a.runbook == runbook_link(Runbook.BLIND_NODE) and a.details["frozen_here"] is True
    assert says(a.summary, "engine 0", "frozen", "2 running", "node worker1", "Connection timed out")
    assert says(a.summary, "power-cycle", "watchdog reset")
    assert s.recovery.jobs == [] and s.r.memory.incident is None  # blind never restarts, opens no frozen incident
    s.step(State.FROZEN, [LOST], advance=10, reason="still", stalled=55)
    assert s.sent() == ["blind"]  # said once
    s.step(State.FROZEN, [SEEN], reason="no progress for 66s", stalled=66)
    assert s.sent() == ["blind", "resolved", "stall_detected"]  # sight back: the freeze is its own incident now
    frozen = s.alerts[-1]
    assert frozen.incident_id != a.incident_id and s.r.memory.incident is not None
    assert s.r.memory.incident.kind == "frozen"


def test_a_stall_after_the_blind_alert_is_said_once_as_blind_frozen(s: Stack) -> None:
    s.step(State.IDLE, [LOST])
    s.step(State.IDLE, [LOST], advance=61)
    s.step(State.SUSPECT, [LOST], reason="no progress for 6s with work pending (1 running)", stalled=6)
    assert s.sent() == ["blind"]  # a stall, not yet a freeze
    s.step(State.FROZEN, [LOST], advance=40, reason="no progress for 46s", stalled=46)
    s.step(State.FROZEN, [LOST], advance=10, reason="no progress for 56s", stalled=56)
    assert s.sent() == ["blind", "blind_frozen"]
    later = s.alerts[1]
    assert later.incident_id == s.alerts[0].incident_id and later.runbook == runbook_link(Runbook.BLIND_NODE)
    assert says(later.summary, "engine 0", "frozen", "46s", "node worker1", "power-cycle", "watchdog reset")
    assert json.loads((s.tmp / "recovery.json").read_text())["blind"][0]["phase"] == "frozen_here"


def test_an_open_freeze_is_named_and_waits_while_its_node_is_unseen(s: Stack) -> None:
    s.step(State.WORKING, [SEEN])
    s.step(State.FROZEN, [SEEN], reason="frozen", stalled=45)
    frozen = s.r.memory.incident
    assert frozen is not None and s.sent() == ["stall_detected"]
    s.step(State.FROZEN, [LOST], reason="frozen", stalled=46)
    s.r.evidence("0", "stuck", "/var/lib/x/incidents/b1", {})  # its stacks: the restart would go now
    for _ in range(7):
        s.step(State.FROZEN, [LOST], advance=10, reason="frozen", stalled=50)
    assert s.sent() == ["stall_detected", "evidence_captured", "blind"] and s.recovery.jobs == []
    assert s.alerts[-1].details["incident"] == frozen.id and says(s.alerts[-1].summary, frozen.id)
    s.step(State.FROZEN, [SEEN], reason="frozen", stalled=130)
    assert s.sent()[-2:] == ["resolved", "restart_started"]  # sight back: the frozen incident goes its usual way
    assert s.alerts[-2].incident_id != frozen.id and s.alerts[-1].incident_id == frozen.id


def test_the_page_unreadable_is_alerted_with_the_scrapes_error(s: Stack) -> None:
    why = "cannot read the page (timeout): no answer within 5s"
    s.step(State.IDLE, [])
    s.step(State.BLIND, [], reason=why)
    s.step(State.BLIND, [], advance=60, reason=why)
    [a] = s.alerts
    assert a.event == "blind" and a.runbook == runbook_link(Runbook.BLIND_PAGE) and a.details["node"] is None
    assert says(a.summary, "page", "60s", "timeout", "no answer within 5s")
    s.step(State.IDLE, [])
    assert s.sent() == ["blind", "resolved"] and s.recovery.jobs == []


def test_paused_opens_nothing_and_a_node_still_unseen_after_the_pause_is_alerted_at_once(s: Stack) -> None:
    save_control(s.tmp, Control(paused=True, reason="rebooting worker1", paused_at=T0))
    s.step(State.IDLE, [LOST])
    s.step(State.IDLE, [LOST], advance=300)
    assert s.sent() == [] and not [e for e in s.events if e["event"] == "incident_opened"]
    save_control(s.tmp, Control(paused=False))
    s.step(State.IDLE, [LOST], advance=2)
    assert s.sent() == ["blind"] and says(s.alerts[0].summary, "302s")
    save_control(s.tmp, Control(paused=True, reason="again", paused_at=s.wall))
    s.step(State.IDLE, [SEEN], advance=2)  # resolved while paused: written, not sent (as every alert then)
    assert s.sent() == ["blind"]
    assert [e["alert"] for e in s.events if e["event"] == "alert_suppressed"] == ["resolved"]
    assert s.r.memory.blind == ()


def test_a_restarted_watchdog_resolves_the_blind_incident_it_left_open(s: Stack) -> None:
    s.step(State.IDLE, [LOST])
    s.step(State.IDLE, [LOST], advance=61)
    [a] = s.alerts
    assert [b.id for b in load_memory(s.tmp).blind] == [a.incident_id]
    again = Stack(s.tmp, s.cfg, mono=5.0, wall=s.wall + 30)  # a new process: a new monotonic clock
    again.step(State.IDLE, [LOST])  # still unseen while its stream starts: no second incident
    assert again.sent() == [] and again.status()["blind"][0]["incident"] == a.incident_id
    again.step(State.IDLE, [SEEN])
    [done] = again.alerts
    assert done.event == "resolved" and done.incident_id == a.incident_id and says(done.summary, "93s")


def test_blind_after_is_the_setting(tmp_path: Path) -> None:
    s = Stack(tmp_path, config(blind_after=5.0))
    s.step(State.IDLE, [LOST])
    s.step(State.IDLE, [LOST], advance=4)
    assert s.sent() == []
    s.step(State.IDLE, [LOST], advance=1)
    assert s.sent() == ["blind"]


def test_the_exporter_shows_how_long_each_thing_is_unseen_and_zero_once_seen() -> None:
    e = Exporter()

    def value() -> str:
        return next(ln for ln in generate_latest(e.registry).decode().splitlines()
                    if ln.startswith('watchdog_blind_seconds{what="node:worker1"}'))

    e.set_response({"incident": None, "blind": [{"what": "node:worker1", "seconds": 61.0}]})
    assert value().endswith(" 61.0")
    e.set_response({"incident": None, "blind": []})
    assert value().endswith(" 0.0")


@pytest.mark.parametrize("value", ["0", "-1.0", "nan"])
def test_blind_after_must_be_above_zero(tmp_path: Path, value: str) -> None:
    path = tmp_path / "watchdog.toml"
    path.write_text(f"[alerts]\nblind_after = {value}\n")
    with pytest.raises(ConfigError, match=r"alerts\.blind_after"):
        load(path)
    path.write_text("[alerts]\nblind_after = 5.0\n")
    assert load(path).alerts.blind_after == 5.0
