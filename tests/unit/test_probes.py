"""What /readyz and /livez decide (watchdog.service.probes): verdicts, times and the watchdog's own health in, a code
and a short body out."""

from __future__ import annotations

import pytest

from watchdog.core.types import State, Verdict
from watchdog.service.probes import (
    OpenIncident,
    ProbeSettings,
    carry_trouble,
    liveness,
    own_problem,
    probe_problems,
    readiness,
    stale_after,
)


def v(state: State, engine: str = "0", since: float = 0.0, t: float = 100.0, reason: str = "why") -> Verdict:
    return Verdict(engine, state, reason, since, t)


@pytest.mark.parametrize(("state", "code"), [
    (State.IDLE, 200), (State.WORKING, 200),
    (State.SUSPECT, 200),  # ready until it is frozen: the stacks may still explain a long step
    (State.STARTING, 503),  # no generation has proven it yet
    (State.FROZEN, 503), (State.DOWN, 503),
    (State.BLIND, 503),  # the watchdog cannot see it: it never vouches for it
])
def test_ready_by_state(state: State, code: int) -> None:
    a = readiness([v(state, since=40.0)], 100.0, None, "")
    assert a.code == code
    assert a.body["ready"] is (code == 200)
    assert a.body["state"] == state.value and a.body["engine"] == "0"
    assert a.body["for_seconds"] == 60.0 and a.body["watchdog"] == "ok"


def test_one_engine_not_ready_makes_the_whole_not_ready_and_says_which() -> None:
    verdicts = [v(State.WORKING, "0"), v(State.FROZEN, "1", since=90.0, reason="no progress for 40s")]
    a = readiness(verdicts, 100.0, OpenIncident("1", "20261201T094757Z-vllm-engine1-frozen-2fdf"), "")
    assert a.code == 503
    assert a.body["engine"] == "1" and a.body["reason"] == "no progress for 40s" and a.body["for_seconds"] == 10.0
    assert a.body["incident"] == "20261201T094757Z-vllm-engine1-frozen-2fdf"
    assert a.body["engines"] == {"0": "working", "1": "frozen"}
    one = readiness(verdicts, 100.0, OpenIncident("1", "x"), "", engine="0")
    assert one.code == 200 and one.body["engine"] == "0" and one.body["incident"] is None  # not this engine's
    assert "engines" not in one.body


@pytest.mark.parametrize("phase", ["restarting", "proving"])
def test_an_engine_being_restarted_is_not_ready_until_recovered_though_its_page_says_idle(phase: str) -> None:
    # the restarted engine's metrics answer (idle) before the watchdog's first generation proved it serves: a load
    # balancer must not send it traffic yet
    verdicts = [v(State.IDLE, "0"), v(State.IDLE, "1", since=95.0)]
    a = readiness(verdicts, 100.0, OpenIncident("1", "inc-7", phase), "")
    assert a.code == 503 and a.body["engine"] == "1" and a.body["state"] == "idle"
    assert a.body["recovery"] == phase and a.body["incident"] == "inc-7" and "first generation" in str(a.body["reason"])
    assert readiness(verdicts, 100.0, OpenIncident("1", "inc-7", phase), "", engine="0").code == 200  # the other
    for done in ("observing", "open"):  # not restarting it: the state alone decides
        assert readiness(verdicts, 100.0, OpenIncident("1", "inc-7", done), "").code == 200
    assert readiness(verdicts, 100.0, None, "").code == 200  # recovered: the incident is closed


def test_an_engine_not_watched_is_404_and_no_verdict_yet_is_not_ready() -> None:
    a = readiness([v(State.IDLE)], 100.0, None, "", engine="7")
    assert a.code == 404 and a.body["engines"] == ["0"]
    assert liveness([v(State.IDLE)], 100.0, {}, None, "", 300.0, engine="7").code == 404
    first = readiness([], 0.0, None, "")
    assert first.code == 503 and first.body["reason"] == "no verdict yet"
    assert liveness([], 0.0, {}, None, "", 300.0).code == 200  # nothing known to be wrong


def test_live_fails_only_after_frozen_or_down_longer_than_the_setting() -> None:
    frozen = [v(State.FROZEN, since=50.0)]
    trouble = carry_trouble({}, frozen)
    assert liveness(frozen, 100.0, trouble, None, "", 300.0).code == 200
    late = liveness(frozen, 351.0, trouble, OpenIncident("0", "inc"), "", 300.0)
    assert late.code == 503 and late.body["for_seconds"] == 301.0 and late.body["live_after"] == 300.0
    assert late.body["incident"] == "inc"
    for state in (State.STARTING, State.BLIND, State.SUSPECT, State.IDLE):  # never the kubelet's business
        verdicts = [v(state, since=0.0)]
        assert liveness(verdicts, 10_000.0, carry_trouble({}, verdicts), None, "", 300.0).code == 200, state


def test_a_freeze_that_turns_down_is_one_stretch_of_trouble() -> None:
    trouble = carry_trouble({}, [v(State.FROZEN, since=10.0)])
    trouble = carry_trouble(trouble, [v(State.DOWN, since=250.0)])  # vLLM's own timeout killed it
    assert trouble == {"0": 10.0}
    assert liveness([v(State.DOWN, since=250.0)], 320.0, trouble, None, "", 300.0).code == 503
    trouble = carry_trouble(trouble, [v(State.STARTING, since=330.0)])  # restarted: the stretch ends
    assert trouble == {}
    trouble = carry_trouble(trouble, [v(State.DOWN, since=400.0)])
    assert trouble == {"0": 400.0}


def test_the_watchdogs_own_health_fails_both() -> None:
    s = ProbeSettings(live_after=300.0, stale_after=30.0)
    stuck = own_problem(45.0, 1000.0, s)
    assert "no pass for 45s" in stuck
    assert own_problem(2.0, 1000.0, s) == ""
    assert own_problem(None, 10.0, s) == ""  # still on its first pass
    assert "since it started" in own_problem(None, 31.0, s)
    disk = own_problem(1.0, 1000.0, s, "no space left")
    assert disk == "the watchdog's state directory cannot be used: no space left"
    r = readiness([v(State.IDLE)], 100.0, None, stuck)
    live = liveness([v(State.IDLE)], 100.0, {}, None, stuck, 300.0)
    assert r.code == live.code == 503
    assert r.body["watchdog"] == live.body["watchdog"] == stuck
    assert liveness([], 0.0, {}, None, stuck, 300.0).code == 503


def test_the_state_directory_fails_readiness_only() -> None:
    """Recreating the pod gives a full disk no room, and /livez is wired to the engine's container: a state
    directory that cannot be used takes the engines out (/readyz) but never restarts them (/livez)."""
    s = ProbeSettings(live_after=300.0, stale_after=30.0)
    ready, live = probe_problems(1.0, 1000.0, s, "no space left")
    assert ready == "the watchdog's state directory cannot be used: no space left" and live == ""
    assert readiness([v(State.IDLE)], 100.0, None, ready).code == 503
    assert liveness([v(State.IDLE)], 100.0, {}, None, live, 300.0).code == 200
    ready, live = probe_problems(45.0, 1000.0, s, "no space left")  # a stuck loop still fails both
    assert "cannot be used" in ready and "no pass for 45s" in live
    assert probe_problems(None, 31.0, s) == (own_problem(None, 31.0, s),) * 2


def test_long_reasons_are_cut_and_the_stale_bound_follows_the_scrape() -> None:
    a = readiness([v(State.FROZEN, reason="x" * 5000)], 100.0, None, "")
    assert len(str(a.body["reason"])) == 300 and str(a.body["reason"]).endswith("...")
    assert stale_after(1.0, 10.0) == 33.0
    assert stale_after(0.2, 1.0) == 30.0
