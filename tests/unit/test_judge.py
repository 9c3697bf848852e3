"""The judgement, exhaustively, with hand-made observations and time passed in as data."""

from __future__ import annotations

import itertools

import pytest

from tests.facts import says
from watchdog.core.types import (
    Decision,
    EngineReading,
    PageReading,
    ProbeFinished,
    ProbeStarted,
    Scrape,
    StackEvidence,
    State,
)
from watchdog.judge.judge import SERVER, Judge, worst
from watchdog.judge.track import Thresholds

TH = Thresholds(suspect_after=15, stall_window=40, probe_interval=30, probe_retry=5)


def page(t: float, engines: dict[str, dict[str, float]] | None = None, **one: float) -> Scrape:
    """A scrape at time t. ``one`` describes engine "0": running, waiting, kv, gen, prompt, success."""
    engines = engines if engines is not None else {"0": one}
    readings = {}
    for name, e in engines.items():
        counters = {k: v for k, v in (("generation_tokens", e.get("gen", 0.0)), ("prompt_tokens", e.get("prompt", 0.0)),
                                      ("request_success", e.get("success", 0.0)))}
        readings[name] = EngineReading(name, "m", e.get("running", 0.0), e.get("waiting", 0.0), e.get("kv", 0.0),
                                       counters)
    return Scrape(t, 1e9 + t, PageReading(readings, vllm_series=10 * len(readings)))


def failed(t: float, kind: str, msg: str = "boom") -> Scrape:
    return Scrape(t, 1e9 + t, None, kind, msg)


def states(judge: Judge) -> dict[str, State]:
    return {v.engine: v.state for v in judge.verdicts()}


def ready_judge(t: float = 0.0, th: Thresholds = TH) -> Judge:
    """A judge that has seen the engine serve (tokens moved) and go idle."""
    j = Judge(th)
    j.observe(page(t, gen=10, prompt=10))
    j.observe(page(t + 1, gen=20, prompt=20))
    assert states(j) == {"0": State.IDLE}
    return j


def test_first_sight_of_idle_engine_is_starting_until_a_probe_proves_it() -> None:
    j = Judge(TH)
    j.observe(page(0, gen=5))
    assert states(j) == {"0": State.STARTING}
    assert j.wants_probe(0)
    j.observe(ProbeStarted(0.1, 1))
    assert not j.wants_probe(0.2)  # at most one in flight
    j.observe(ProbeFinished(0.5, 1, ok=True, answered=True))
    j.observe(page(1, gen=6, prompt=5))
    assert states(j) == {"0": State.IDLE}


def test_a_watchdog_started_over_an_engine_that_served_calls_its_lost_probe_a_freeze() -> None:
    """Started (or restarted) over a wedged engine with nothing on its page but the watchdog's own probe: the engine
    had served (its counters are above 0), so the probe outstanding is pending work, not a warm-up."""
    j = Judge(TH)
    j.observe(page(0, gen=5))
    assert states(j) == {"0": State.STARTING}
    j.observe(ProbeStarted(0.1, 1))
    seen = []
    for t in range(1, int(TH.stall_window) + 3):
        j.observe(page(t, gen=5))
        seen.append(states(j)["0"])
    assert State.SUSPECT in seen and seen[-1] == State.FROZEN, seen


def test_a_fresh_engine_whose_first_generation_is_slow_stays_starting() -> None:
    """Counters at 0 when first seen: a new engine warming up; its slow first generation is the boot's business."""
    j = Judge(TH)
    j.observe(page(0))
    j.observe(ProbeStarted(0.1, 1))
    for t in range(1, int(TH.stall_window) * 3):
        j.observe(page(t))
        assert states(j) == {"0": State.STARTING}


def test_steady_progress_is_working_never_frozen() -> None:
    j = ready_judge()
    for i in range(2, 300):
        j.observe(page(i, running=4, gen=20 + 3 * i, kv=0.01))
        assert states(j) == {"0": State.WORKING}


def test_flat_counters_with_work_pending_go_suspect_then_frozen_at_the_window() -> None:
    j = ready_judge()
    j.observe(page(2, running=4, gen=30))  # work arrives, progress
    seen = {}
    for t in range(3, 60):
        for tr in j.observe(page(t, running=4, gen=30)):
            seen[tr.to_state] = t
    assert seen[State.SUSPECT] == 2 + 15
    assert seen[State.FROZEN] == 2 + 40
    v = j.verdicts()[0]
    assert v.state == State.FROZEN and "no progress for" in v.reason and "running=4" in v.reason


def test_kv_usage_moving_keeps_a_long_prefill_working() -> None:
    """Measured: a 17 s chunked prefill moves only kv_cache_usage_perc. Here: 15 minutes of it."""
    j = ready_judge()
    for t in range(2, 900):
        j.observe(page(t, running=1, gen=20, prompt=20, kv=0.001 * t))
        assert states(j)["0"] == State.WORKING
    j.observe(page(900, running=0, gen=21, prompt=900_020, kv=0))
    assert states(j) == {"0": State.IDLE}


def test_idle_is_never_frozen_and_probes_at_the_interval() -> None:
    j = ready_judge()
    probes = 0
    ids = itertools.count(1)
    for t in range(2, 600):
        if j.wants_probe(t):
            pid = next(ids)
            j.observe(ProbeStarted(t, pid))
            j.observe(ProbeFinished(t + 0.3, pid, ok=True, answered=True))
            probes += 1
        j.observe(page(t + 0.5, gen=20 + probes, prompt=20 + probes))
        assert states(j) == {"0": State.IDLE}
    assert 18 <= probes <= 21  # every 30 s over ~600 s


def test_invisible_wedge_is_found_by_the_stuck_probe() -> None:
    """The first step after idle hangs: the page keeps running=0, waiting=0; only the probe shows it."""
    j = ready_judge()
    j.observe(ProbeStarted(40, 1))  # never answered
    seen = {}
    for t in range(40, 100):
        for tr in j.observe(page(t + 0.5, gen=20, prompt=20)):
            seen.setdefault(tr.to_state, t)
    assert seen[State.SUSPECT] == 40 + 15
    assert seen[State.FROZEN] == 40 + 40
    assert "probe" in j.verdicts()[0].reason


def test_probe_that_times_out_keeps_the_engine_pending_until_something_serves() -> None:
    j = ready_judge()
    j.observe(ProbeStarted(10, 1))
    j.observe(ProbeFinished(70, 1, ok=False, answered=False, detail="no answer within 60s"))
    j.observe(page(71, gen=20, prompt=20))
    assert states(j) == {"0": State.FROZEN}  # the timed-out probe is evidence, not forgotten
    assert j.wants_probe(76)  # keeps probing (retry gap) to see recovery
    j.observe(ProbeStarted(76, 2))
    j.observe(ProbeFinished(76.3, 2, ok=True, answered=True))
    j.observe(page(77, gen=21, prompt=30))
    assert states(j) == {"0": State.IDLE}


def test_a_probe_refused_by_the_server_is_not_a_wedge() -> None:
    j = Judge(TH)
    j.observe(page(0))
    j.observe(ProbeStarted(0, 1))
    j.observe(ProbeFinished(0.2, 1, ok=False, answered=True, detail="HTTP 404 from /v1/completions: no model"))
    j.observe(page(1))
    v = j.verdicts()[0]
    assert v.state == State.STARTING and "HTTP 404" in v.reason
    assert not j.wants_probe(2) and j.wants_probe(5.1)  # retries at probe_retry while starting


def test_probe_queued_behind_a_long_prefill_is_no_false_alarm() -> None:
    j = ready_judge()
    j.observe(ProbeStarted(2, 1))  # the probe waits behind a prefill for 200 s
    for t in range(3, 200):
        j.observe(page(t, running=1, waiting=1, gen=20, prompt=20, kv=0.0005 * t))
        assert states(j)["0"] == State.WORKING


def test_counter_reset_is_a_new_incarnation_not_progress_nor_freeze() -> None:
    j = ready_judge()
    j.observe(page(5, running=2, gen=500, prompt=20))
    trs = j.observe(page(6, running=0, gen=3))
    v = j.verdicts()[0]
    assert v.state == State.STARTING and v.incarnation == 2 and "restarted" in v.reason
    assert [t.to_state for t in trs] == [State.STARTING]


def test_refused_is_down_then_no_answer_is_starting_then_a_probe_makes_it_idle() -> None:
    j = ready_judge()
    j.observe(failed(5, "refused", "nothing listening"))
    assert states(j) == {"0": State.DOWN}
    j.observe(failed(6, "no_answer", "accepted, no response"))
    assert states(j) == {"0": State.STARTING}
    j.observe(page(30, gen=0))
    assert states(j) == {"0": State.STARTING}
    j.observe(ProbeStarted(30, 1))
    j.observe(ProbeFinished(30.2, 1, True, True))
    j.observe(page(31, gen=1, prompt=5))
    assert states(j) == {"0": State.IDLE}
    assert j.verdicts()[0].incarnation == 2


def test_no_answer_after_answering_is_down() -> None:
    j = ready_judge()
    j.observe(failed(5, "no_answer", "accepted, no response"))
    assert states(j) == {"0": State.DOWN}
    assert "stopped answering" in j.verdicts()[0].reason


def test_before_any_page_failures_are_reported_for_the_server() -> None:
    j = Judge(TH)
    j.observe(failed(0, "refused"))
    assert states(j) == {SERVER: State.DOWN}
    j.observe(failed(1, "no_answer"))
    assert states(j) == {SERVER: State.STARTING}
    j.observe(page(2))
    assert states(j) == {"0": State.STARTING}


@pytest.mark.parametrize("kind", ["html", "too_big", "trickle", "truncated", "malformed", "duplicate", "redirects",
                                  "http_status", "not_text", "page_hangs"])
def test_unreadable_pages_are_blind_never_healthy(kind: str) -> None:
    j = ready_judge()
    j.observe(failed(5, kind, "details"))
    v = j.verdicts()[0]
    assert v.state == State.BLIND and kind in v.reason


def test_http_5xx_is_down_but_keeps_the_incarnation() -> None:
    j = ready_judge()
    j.observe(failed(5, "http_5xx", "HTTP 500"))
    assert states(j) == {"0": State.DOWN}
    j.observe(page(6, gen=20, prompt=20))
    assert states(j) == {"0": State.IDLE}


def test_page_without_engine_series_is_blind_and_says_why() -> None:
    j = Judge(TH)
    j.observe(Scrape(0, 0, PageReading({}, vllm_series=0)))
    assert "not a vLLM server" in j.verdicts()[0].reason
    j.observe(Scrape(1, 1, PageReading({}, vllm_series=3)))
    v = j.verdicts()[0]
    assert v.state == State.BLIND and "--disable-log-stats" in v.reason


def test_missing_gauge_is_blind_for_that_engine() -> None:
    j = Judge(TH)
    j.observe(Scrape(0, 0, PageReading({"0": EngineReading("0", running=None, waiting=0.0,
                                                           counters={"generation_tokens": 1.0})}, 5)))
    v = j.verdicts()[0]
    assert v.state == State.BLIND and "vllm:num_requests_running" in v.reason


def test_blind_period_does_not_count_as_progress() -> None:
    j = ready_judge()
    j.observe(page(2, running=3, gen=30))
    for t in range(3, 50):
        j.observe(failed(t, "trickle"))
    j.observe(page(50, running=3, gen=30))
    assert states(j) == {"0": State.FROZEN}


def test_data_parallel_engines_are_judged_separately() -> None:
    j = Judge(TH)
    j.observe(page(0, {"0": {"running": 2, "gen": 10}, "1": {"running": 2, "gen": 10}}))
    for t in range(1, 45):
        j.observe(page(t, {"0": {"running": 2, "gen": 10 + t}, "1": {"running": 2, "gen": 10}}))
    assert states(j) == {"0": State.WORKING, "1": State.FROZEN}
    assert worst(j.verdicts()).engine == "1"  # type: ignore[union-attr]


def test_engine_vanishing_from_the_page_is_down() -> None:
    j = Judge(TH)
    j.observe(page(0, {"0": {"gen": 1}, "1": {"gen": 1}}))
    j.observe(page(1, {"0": {"gen": 1}}))
    assert states(j)["1"] == State.DOWN


def suspect_at(t_end: int = 20) -> Judge:
    """Work pending from t=2, nothing moving: suspect from t=17 (suspect_after 15)."""
    j = ready_judge()
    for t in range(2, t_end):
        j.observe(page(t, running=1, gen=30))
    assert states(j) == {"0": State.SUSPECT}
    return j


def test_stack_evidence_confirms_early_or_explains_a_long_step() -> None:
    j = suspect_at()
    j.observe(StackEvidence(20, "0", Decision.WORKING, "Worker_TP0 inside the model forward", captured_at=19))
    v = j.verdicts()[0]
    assert v.state == State.WORKING and v.stacks_only and "a long step" in v.reason and "model forward" in v.reason
    for t in range(21, 80):  # far past the 40 s window: the stacks explained it, the page cannot
        j.observe(page(t, running=1, gen=30))
    assert states(j) == {"0": State.WORKING}
    # a re-check finds every rank parked: frozen now
    j.observe(StackEvidence(80, "0", Decision.STUCK, "every rank parked in the reader wait", captured_at=79))
    v = j.verdicts()[0]
    assert v.state == State.FROZEN and says(v.reason, "re-check", "long step", "every rank parked in the reader wait")
    j.observe(page(81, running=1, gen=30))
    assert states(j) == {"0": State.FROZEN}  # stays confirmed while nothing moves
    j.observe(page(82, running=1, gen=31))
    assert states(j) == {"0": State.WORKING} and not j.verdicts()[0].stacks_only  # progress clears it


def test_an_explained_long_step_is_one_steady_working_rechecked_at_growing_intervals() -> None:
    """Seen on the real engine: a long step cycled suspect -> working -> suspect every ~20 s (55 events in 5
    minutes). Explained once, it stays one `working`; the stacks are looked at again after 15, 30, 60 ... s."""
    j = suspect_at()
    transitions = j.observe(StackEvidence(20, "0", Decision.WORKING, "Worker_TP1 is model_forward", captured_at=19))
    due: list[int] = []
    for t in range(21, 400):
        transitions += j.observe(page(t, running=1, gen=30))
        if j.wants_stacks(t):
            due.append(t)
            transitions += j.observe(StackEvidence(t + 1, "0", Decision.WORKING, "Worker_TP1 is model_forward",
                                                   captured_at=t))
    assert [tr.to_state for tr in transitions] == [State.WORKING]
    # each look is due 15, 30, 60, 120 s after the last reading arrived (a second after it was asked for)
    assert due == [35, 35 + 31, 35 + 31 + 61, 35 + 31 + 61 + 121]
    assert "checked" in j.verdicts()[0].reason and "next look in" in j.verdicts()[0].reason


def test_stacks_never_undo_a_freeze() -> None:
    """Once frozen only the page (or a successful generation) clears it: a late "working" reading, even one taken
    after the freeze began, only ever holds the restart (the responder's business), never resolves."""
    j = ready_judge()
    for t in range(2, 50):
        j.observe(page(t, running=1, gen=30))
    assert states(j) == {"0": State.FROZEN}
    assert j.observe(StackEvidence(50, "0", Decision.WORKING, "Worker_TP0 inside the model forward",
                                   captured_at=49)) == []
    j.observe(page(51, running=1, gen=30))
    assert states(j) == {"0": State.FROZEN}


def test_evidence_older_than_the_current_state_says_nothing() -> None:
    """Seen: vLLM's own timeout ended the engine; 3 s after `down` a check taken before the death arrived and
    turned `down` into `working`. Evidence taken before the current state began is stale."""
    j = suspect_at()
    j.observe(failed(21, "refused", "nothing listening"))
    assert states(j) == {"0": State.DOWN}
    assert j.observe(StackEvidence(24, "0", Decision.WORKING, "Worker_TP0 is model_forward", captured_at=19)) == []
    assert j.observe(StackEvidence(24, "0", Decision.STUCK, "parked", captured_at=19)) == []
    assert states(j) == {"0": State.DOWN}


def test_frozen_recovers_when_progress_resumes() -> None:
    j = ready_judge()
    for t in range(2, 50):
        j.observe(page(t, running=2, gen=20))
    assert states(j) == {"0": State.FROZEN}
    trs = j.observe(page(50, running=2, gen=25))
    assert [(t.from_state, t.to_state) for t in trs] == [(State.FROZEN, State.WORKING)]


def test_transitions_only_on_state_change() -> None:
    j = ready_judge()
    assert j.observe(page(2, gen=20, prompt=20)) == []
    assert j.observe(page(3, gen=20, prompt=20)) == []


def test_stall_clock_starts_when_work_appears_not_at_last_progress() -> None:
    """Idle for an hour, then a request: the hour of silence is not a stall."""
    j = ready_judge()
    j.observe(page(3600, gen=20, prompt=20))
    j.observe(page(3601, running=1, gen=20, prompt=20))
    assert states(j) == {"0": State.WORKING}


def test_closed_port_with_a_new_server_process_is_starting_an_old_one_dying_is_down() -> None:
    """vLLM binds its port only after loading: while it loads, the port refuses but its process runs."""
    from watchdog.judge.judge import ServerProcess

    j = Judge(TH)
    j.observe(ServerProcess(0, 4242, started_wall=1e9 - 30, titles=("VLLM::EngineCore",)))
    j.observe(failed(0, "refused", "nothing listening"))
    v = j.verdicts()[0]
    assert v.state == State.STARTING and "pid 4242" in v.reason and "VLLM::EngineCore" in v.reason
    j.observe(page(30, gen=0))  # answers (wall 1e9 + 30)
    # the server dies: the port closes while its old processes are still on their way out
    j.observe(ServerProcess(40, 4242, started_wall=1e9 - 30, titles=("VLLM::EngineCore",)))
    j.observe(failed(40, "refused"))
    assert states(j) == {"0": State.DOWN}
    j.observe(ServerProcess(45, None))
    j.observe(failed(45, "refused"))
    assert states(j) == {"0": State.DOWN}
    # a new server process for the port, started after the last answer: starting
    j.observe(ServerProcess(60, 5151, started_wall=1e9 + 55))
    j.observe(failed(60, "refused"))
    v = j.verdicts()[0]
    assert v.state == State.STARTING and "no engine process yet" in v.reason
    # a stale sighting (older than a few seconds) does not count
    j.observe(failed(70, "refused"))
    assert states(j) == {"0": State.DOWN}


def test_stack_evidence_is_stamped_when_it_arrives_and_stale_if_the_engine_moved_since() -> None:
    j = ready_judge()
    j.observe(page(2, running=1, gen=30))
    for t in range(3, 19):
        j.observe(page(t, running=1, gen=30))
    assert states(j) == {"0": State.SUSPECT}
    # stacks taken at 18, read at 22: the freeze is declared at 22, not back-dated to 18
    trs = j.observe(StackEvidence(22, "0", Decision.STUCK, "parked", captured_at=18))
    assert [(t.to_state, t.t) for t in trs] == [(State.FROZEN, 22)]
    # stacks taken before the engine last moved say nothing about now
    j2 = ready_judge()
    for t in range(2, 19):
        j2.observe(page(t, running=1, gen=30))
    j2.observe(page(19, running=1, gen=31))
    assert j2.observe(StackEvidence(21, "0", Decision.STUCK, "parked", captured_at=18.5)) == []


def test_undecided_stacks_leave_it_to_the_window_and_the_verdict_says_so() -> None:
    j = ready_judge()
    j.observe(page(2, running=1, gen=30))
    for t in range(3, 18):
        j.observe(page(t, running=1, gen=30))
    assert j.observe(StackEvidence(18, "0", Decision.UNDECIDED, "incomplete capture (py-spy was not found)",
                                   captured_at=17)) == []
    assert states(j) == {"0": State.SUSPECT}
    for t in range(18, 45):
        j.observe(page(t, running=1, gen=30))
    v = j.verdicts()[0]
    assert v.state == State.FROZEN
    assert says(v.reason, "metrics only", "incomplete capture (py-spy was not found)"), v.reason  # the stacks' word


def test_a_slow_first_generation_after_a_start_is_starting_not_a_stall() -> None:
    """Measured: the first generation after vLLM starts answering takes 3-20 s (warm-up)."""
    j = Judge(TH)
    j.observe(page(0))
    j.observe(ProbeStarted(0.1, 1))
    for t in range(1, 120):
        j.observe(page(t))
        assert states(j) == {"0": State.STARTING}
    assert "outstanding for 119s" in j.verdicts()[0].reason
    j.observe(ProbeFinished(120, 1, ok=True, answered=True))
    j.observe(page(121, gen=1, prompt=5))
    assert states(j) == {"0": State.IDLE}


def test_a_suspicion_the_stacks_could_not_decide_is_looked_at_again() -> None:
    """Seen in a clean CI run: py-spy timed out on every spinning process of an admission stall (two saturated
    cores), the capture was incomplete, and the suspicion waited for the metric window alone. The stacks are asked
    again suspect_after later, then twice that, while the suspicion lasts; progress ends the retries."""
    j = suspect_at()
    assert j.observe(StackEvidence(20, "0", Decision.UNDECIDED, "incomplete capture (py-spy timed out)",
                                   captured_at=19)) == []
    due = [t for t in range(21, 36) if j.observe(page(t, running=1, gen=30)) == [] and j.wants_stacks(t)]
    assert due == [35]  # 15 s (suspect_after) after the answer came
    assert j.observe(StackEvidence(36, "0", Decision.UNDECIDED, "incomplete capture", captured_at=35)) == []
    assert not j.wants_stacks(36) and not j.wants_stacks(65) and j.wants_stacks(66)  # then 30 s
    trs = j.observe(StackEvidence(37, "0", Decision.STUCK, "admission stall: running=0, waiting=1", captured_at=36))
    assert [tr.to_state for tr in trs] == [State.FROZEN] and trs[0].reason.startswith("stacks confirm")
    j2 = suspect_at()
    j2.observe(StackEvidence(20, "0", Decision.UNDECIDED, "incomplete capture", captured_at=19))
    j2.observe(page(21, running=1, gen=31))  # progress: the suspicion is over
    assert not any(j2.wants_stacks(t) for t in range(21, 200))


@pytest.mark.parametrize("kind", ["trickle", "page_hangs"])
def test_a_frozen_engine_whose_page_turns_unreadable_stays_frozen(kind: str) -> None:
    """Seen in a clean CI run (vLLM 0.32 on CPU, an admission stall): the stacks confirmed the freeze, then the
    stalled engine starved its own API server and the next page trickled in for 10 s. `blind` there ended the freeze
    before the pass that would open its incident: no alert, no restart for as long as the page stayed unreadable,
    and the bundle's id was lost. Nothing on an unreadable page shows progress: the freeze stands, and says why."""
    j = ready_judge()
    for t in range(2, 50):
        j.observe(page(t, running=2, gen=20))
    assert states(j) == {"0": State.FROZEN}
    since = j.verdicts()[0].since
    for t in (50, 51):
        assert j.observe(failed(t, kind, "the page not complete after 10s")) == []
    v = j.verdicts()[0]
    assert v.state == State.FROZEN and v.since == since and v.stalled_for == 51 - 2  # the stall goes on counting
    assert says(v.reason, "page", "cannot be read", kind), v.reason
    assert v.reason.count(kind) == 1  # said once, however long it lasts
    assert j.observe(failed(52, "refused", "nothing listening"))[0].to_state == State.DOWN  # gone is still down
    j = ready_judge()
    for t in range(2, 50):
        j.observe(page(t, running=2, gen=20))
    j.observe(failed(50, "trickle"))
    trs = j.observe(page(51, running=2, gen=25))  # progress on a readable page: the freeze ends
    assert [(t.from_state, t.to_state) for t in trs] == [(State.FROZEN, State.WORKING)]
    assert "cannot be read" not in j.verdicts()[0].reason
