"""The pure decision of a watchdog that cannot see (watchdog.act.blind): what is unseen, for how long, time as data,
and the words of its alert (checked by their facts)."""

from __future__ import annotations

import pytest

from tests.facts import clause_of, says
from watchdog.act import blind
from watchdog.core.runbooks import Runbook
from watchdog.core.types import State, Verdict
from watchdog.nodes.liveness import NodeView, view

AFTER = 60.0


def v(state: State, reason: str = "", engine: str = "0", stalled: float = 0.0) -> Verdict:
    return Verdict(engine, state, reason or f"{state.value} for the test", 0.0, 0.0, stalled_for=stalled)


UNREACHABLE = view("worker1", None, None, 6.0, "ssh: connect to host 10.0.0.2 port 22: Connection timed out")
OK = NodeView("worker1", "ok", "1 rank(s) running on node worker1")


def test_what_cannot_be_seen_is_named_with_its_reason() -> None:
    page = v(State.BLIND, "cannot read the page (timeout): read timed out after 5s")
    [u] = blind.unseen([page], [])
    assert (u.what, u.engines, u.runbook, u.node) == ("page", ("0",), Runbook.BLIND_PAGE, "")
    assert says(u.why, "timeout", "5s")
    [n] = blind.unseen([v(State.IDLE)], [UNREACHABLE, OK])
    assert (n.what, n.node, n.runbook, n.engines) == ("node:worker1", "worker1", Runbook.BLIND_NODE, ("0",))
    assert says(n.why, "Connection timed out") and "cannot see node" not in n.why  # the view's own words, once
    assert blind.unseen([v(State.IDLE), v(State.DOWN, engine="1")], [OK]) == []  # down is seen: it is down


def test_blind_59s_no_incident_61s_one_then_resolved_when_seen() -> None:
    [u] = blind.unseen([v(State.IDLE)], [UNREACHABLE])
    first = blind.rule(1000.0, [u], {}, (), (), AFTER, frozen_here=False)
    assert first.since == {"node:worker1": 1000.0} and not first.open
    at59 = blind.rule(1059.0, [u], first.since, (), (), AFTER, frozen_here=False)
    assert not at59.open and at59.since == first.since  # the onset is kept, not moved
    at61 = blind.rule(1061.0, [u], at59.since, (), (), AFTER, frozen_here=False)
    assert at61.open == (u,)
    # open now: not opened again; sight back: resolved, and nothing left to count
    assert not blind.rule(1062.0, [u], at61.since, ["node:worker1"], (), AFTER, frozen_here=False).open
    back = blind.rule(1070.0, [], at61.since, ["node:worker1"], (), AFTER, frozen_here=False)
    assert back.seen == ("node:worker1",) and back.since == {} and not back.open


def test_a_blip_shorter_than_blind_after_never_opens_and_starts_again_from_zero() -> None:
    [u] = blind.unseen([v(State.IDLE)], [UNREACHABLE])
    r = blind.rule(0.0, [u], {}, (), (), AFTER, frozen_here=False)
    r = blind.rule(50.0, [], r.since, (), (), AFTER, frozen_here=False)  # seen again at 50 s
    assert r.since == {} and not r.seen
    r = blind.rule(51.0, [u], r.since, (), (), AFTER, frozen_here=False)
    assert not blind.rule(110.0, [u], r.since, (), (), AFTER, frozen_here=False).open  # 59 s of the second one
    assert blind.rule(111.0, [u], r.since, (), (), AFTER, frozen_here=False).open == (u,)


def test_paused_keeps_counting_and_opens_once_the_pause_ends() -> None:
    [u] = blind.unseen([v(State.BLIND, "cannot read the page (garbage): no samples")], [])
    r = blind.rule(0.0, [u], {}, (), (), AFTER, frozen_here=False, paused=True)
    assert not blind.rule(300.0, [u], r.since, (), (), AFTER, frozen_here=False, paused=True).open
    assert blind.rule(301.0, [u], r.since, (), (), AFTER, frozen_here=False).open == (u,)


def test_each_thing_is_followed_on_its_own() -> None:
    page = v(State.BLIND, "cannot read the page (refused): no")
    both = blind.unseen([page], [UNREACHABLE])
    assert [u.what for u in both] == ["page", "node:worker1"]
    r = blind.rule(0.0, [both[1]], {}, (), (), AFTER, frozen_here=False)
    r = blind.rule(30.0, both, r.since, (), (), AFTER, frozen_here=False)
    r = blind.rule(60.0, both, r.since, (), (), AFTER, frozen_here=False)
    assert [u.what for u in r.open] == ["node:worker1"]  # the page has been unseen 30 s only
    r = blind.rule(95.0, [both[0]], r.since, ["node:worker1"], (), AFTER, frozen_here=False)
    assert r.seen == ("node:worker1",) and [u.what for u in r.open] == ["page"]


def test_a_stall_here_while_a_node_is_unseen_is_said_once() -> None:
    [u] = blind.unseen([v(State.IDLE)], [UNREACHABLE])
    since = {"node:worker1": 0.0}
    assert blind.rule(70.0, [u], since, ["node:worker1"], (), AFTER, frozen_here=True).frozen == ("node:worker1",)
    assert blind.rule(71.0, [u], since, ["node:worker1"], ["node:worker1"], AFTER, frozen_here=True).frozen == ()
    assert blind.rule(72.0, [u], since, ["node:worker1"], (), AFTER, frozen_here=False).frozen == ()
    page = blind.unseen([v(State.BLIND)], [])
    assert blind.rule(70.0, page, {"page": 0.0}, ["page"], (), AFTER, frozen_here=True).frozen == ()  # nodes only


def test_only_a_confirmed_freeze_here_is_said_later() -> None:
    assert blind.frozen([v(State.FROZEN, stalled=45.0)])
    assert not blind.frozen([v(State.SUSPECT, stalled=8.0)])  # a stall, said in the blind alert, not a freeze yet


@pytest.mark.parametrize(("state", "stalled", "is_stall"), [(State.FROZEN, 45.0, True), (State.SUSPECT, 8.0, True),
                                                           (State.SUSPECT, 0.0, False), (State.WORKING, 0.0, False),
                                                           (State.IDLE, 0.0, False)])
def test_the_local_evidence_of_a_stall(state: State, stalled: float, is_stall: bool) -> None:
    assert bool(blind.stalls([v(state, stalled=stalled)])) is is_stall


def test_frozen_here_while_a_node_is_unseen_says_both() -> None:
    frozen = v(State.FROZEN, "no progress for 45s with work pending (2 running)", stalled=45.0)
    [u] = blind.unseen([frozen], [UNREACHABLE])
    text = blind.summary(u, [frozen], "2030-01-01T00:00:00.000Z", 61.0)
    assert says(clause_of(text, "engine 0", "is frozen"), "here", "45s", "2 running")  # the engine, frozen, here
    assert says(text, "node worker1", "2030-01-01T00:00:00.000Z", "61s", "Connection timed out")  # who, since, why
    assert says(text, "power-cycle", "watchdog reset") and says(text, "Not restarted")
    later = blind.frozen_summary(u, [frozen], "2030-01-01T00:00:00.000Z", 90.0)
    assert says(later, "engine 0", "frozen", "node worker1", "90s", "Connection timed out", "power-cycle")


def test_unseen_without_a_stall_names_what_and_why_and_restarts_nothing() -> None:
    [n] = blind.unseen([v(State.IDLE)], [UNREACHABLE])
    text = blind.summary(n, [v(State.IDLE)], "2030-01-01T00:00:00.000Z", 61.0, incident="inc-7")
    assert says(text, "node worker1", "61s", "Connection timed out", "engine 0 is idle", "inc-7")
    assert "frozen" not in text and "power-cycle" not in text and says(text, "nothing is restarted")
    page = v(State.BLIND, "cannot read the page (http_error): HTTP 404")
    [p] = blind.unseen([page], [])
    text = blind.summary(p, [page], "2030-01-01T00:00:00.000Z", 75.0)
    assert says(text, "page", "75s", "HTTP 404", "engines 0", "nothing is restarted")
    assert says(blind.resolved(blind.name_of("node:worker1"), 80.0), "node worker1", "seen again", "80s")
