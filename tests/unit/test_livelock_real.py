"""The livelock and admission-stall rules on the real thing, without starting vLLM: a page trace recorded with
`watchdog record` and the py-spy dumps of every process, taken from the CPU vLLM 0.32 with the fault injected
(tests/data/livelock/README.md says how).
"""

from __future__ import annotations

import pytest

from tests.facts import says
from tests.unit.livelock_data import DATA, load
from watchdog.core.types import Decision, State
from watchdog.evidence.explain.classes import Cls
from watchdog.evidence.explain.findings import StuckKind, assess
from watchdog.judge.track import Thresholds
from watchdog.service.replay import replay
from watchdog.service.trace import read_trace

QUICK = Thresholds(suspect_after=5.0, stall_window=15.0, probe_interval=0.0)


@pytest.mark.parametrize("fault", ["admission_stall", "livelock"])
def test_the_recorded_page_of_the_fault_goes_suspect_then_frozen(fault: str) -> None:
    states = [t.to_state for t in replay(read_trace(DATA / f"{fault}.trace.jsonl"), QUICK)]
    assert State.FROZEN in states, states
    assert State.SUSPECT in states[:states.index(State.FROZEN)], states


def test_real_stacks_of_an_admission_stall() -> None:
    cap, page, _ = load("admission_stall")
    assert page is not None and page.running == 0 and page.waiting and page.waiting >= 1
    f = assess(cap, work_pending=True, page=page)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.ADMISSION_STALL, f.reason
    assert says(f.reason, "admission stall", "running=0", "waiting=1", "no rank"), f.reason
    core = next(p for p in f.processes if p.process.title == "VLLM::EngineCore")
    assert core.explanation is not None and core.explanation.cls in (Cls.ENGINE_LOOP, Cls.ENGINE_WAITING_WORKERS)
    # the same stacks without the page's stall: nothing says why, and the empty step a worker passed through is
    # taken for a step (the page is what tells an empty step from a long one)
    assert assess(cap, work_pending=True, page=None).stuck_kind is not StuckKind.ADMISSION_STALL


def test_real_stacks_of_a_livelock() -> None:
    cap, page, recorded = load("livelock")
    assert page is not None and page.running and page.running >= 1
    f = assess(cap, work_pending=True, page=page)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LIVELOCK, f.reason
    assert says(f.reason, "livelock", "EngineCore", "engine_loop", "0.99", "3.444 s"), f.reason
    core = next(p for p in f.processes if p.process.title == "VLLM::EngineCore")
    assert core.cpu_seconds is not None and core.gap
    assert 0.1 <= core.cpu_seconds / core.gap < 0.3  # measured 0.29: under the first threshold (0.3), which
    assert recorded["stuck_kind"] == "parked"  # called this livelock "every rank parked" when it was recorded
    assert f.cross_rank.culprit is None or "EngineCore" in f.cross_rank.culprit
