"""The lost wake-up and diverged ranks, told apart on what the real engine showed: bundles the real `watchdog run`
wrote against vLLM 0.25.1 with the faults made inside it (tests/data/hangs/README.md), read back into their
captures and judged again by the real judge, explainer and headline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.hangs_data import DATA, load
from watchdog.core.types import Decision
from watchdog.evidence.explain import known_hangs
from watchdog.evidence.explain.classes import Status
from watchdog.evidence.explain.findings import PageWork, StuckKind, assess
from watchdog.evidence.explain.headline import compose

IDLE, LOADED = PageWork(0.0, 0.0), PageWork(2.0, 0.0)


@pytest.mark.parametrize(("name", "page"), [("lost-wakeup-after-idle-0.25.1", IDLE),
                                            ("lost-wakeup-under-load-0.25.1", LOADED)])
def test_a_lost_wakeup_is_the_readers_parked_with_a_block_written_for_them(name: str, page: PageWork) -> None:
    cap, m = load(name)
    f = assess(cap, work_pending=True, page=page)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LOST_WAKEUP, f.reason
    assert f.hypothesis.status is Status.SUPPORTED, f.hypothesis.reason
    assert f.cross_rank.culprit is None, f.cross_rank.reason  # every rank parked: nobody failed to do its part
    h = compose(f, cap)
    assert h.text.startswith("lost wake-up: Worker_TP0 and Worker_TP1 are parked in their reader with block "), h.text
    assert h.runbook.value == "frozen-all-parked" and h.culprit is None
    assert h.text.split(";")[0] == m["headline"].split(";")[0]  # what the daemon said then
    hang = known_hangs.match(f, cap, "", m["versions"]["vllm"])
    assert hang and hang[0].hang.id == "lost_wakeup" and "upgrade" in hang[0].clause, hang


def test_without_the_ring_the_same_stacks_are_only_parked() -> None:
    cap, _ = load("lost-wakeup-after-idle-0.25.1")
    f = assess(replace(cap, rings=()), work_pending=True, page=IDLE)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED, f.reason
    assert f.hypothesis.status is Status.SUPPORTED  # the stacks alone: the signature, not the block


def test_an_engine_with_the_recheck_is_late_not_stuck() -> None:
    """The same flags read from an engine that re-checks its ring every 5 s (0.27.0 on): the reader takes the block
    by itself. (The version here is set by the test: on the real 0.32.0 the readers were never caught parked.)"""
    cap, _ = load("lost-wakeup-under-load-0.25.1")
    fixed = replace(cap, rings=tuple(replace(r, version="0.32.0") for r in cap.rings))
    f = assess(fixed, work_pending=True, page=LOADED)
    assert f.decision is Decision.WORKING and "re-checks its ring every 5 s" in f.reason, f.reason


def test_diverged_ranks_wait_in_collectives_that_never_match() -> None:
    cap, m = load("diverged-0.25.1")
    f = assess(cap, work_pending=True, page=LOADED)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.DIVERGED, f.reason
    assert f.hypothesis.status is Status.CONTRADICTED, f.hypothesis.reason
    h = compose(f, cap)
    assert h.text.startswith("the ranks diverged: Worker_TP0 waits in all_reduce and Worker_TP1 waits in barrier"), \
        h.text
    assert h.runbook.value == "frozen-ranks-diverged"
    # Worker_TP1, in its barrier, has not read the next blocks: that is not a lost wake-up (it is not parked)
    assert any(b.unread_by() for r in cap.rings for b in r.blocks)
    assert not [x for x in known_hangs.match(f, cap, "", m["versions"]["vllm"]) if x.hang.id == "lost_wakeup"]


def test_every_recorded_bundle_has_its_ring_and_both_rounds() -> None:
    for d in sorted(p for p in DATA.iterdir() if p.is_dir()):
        cap, m = load(d.name)
        assert cap.rings and all(r.ok for r in cap.rings if r.node == "local"), d.name
        assert len(cap.rounds) == 2 and all(x.ok for rnd in cap.rounds for x in rnd.values()), d.name
        assert m["state"] == "frozen", d.name


def test_two_nodes_the_parked_rank_is_named_and_its_peer_is_not_blamed() -> None:
    """Only the head's Worker_TP0 reads the ring; Worker_TP1 on the other node took the step over ZMQ and waits in
    its collective for TP0. Without the ring the rules read TP0's reader as "it left or skipped the collective"."""
    cap, _ = load("lost-wakeup-two-nodes-0.25.1")
    f = assess(cap, work_pending=True, page=IDLE)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LOST_WAKEUP, f.reason
    assert f.hypothesis.status is Status.SUPPORTED, f.hypothesis.reason
    assert f.cross_rank.culprit == "Worker_TP0", f.cross_rank.reason
    h = compose(f, cap)
    assert h.text.startswith("lost wake-up: Worker_TP0 is parked in its reader with block "), h.text
    assert "Worker_TP1 on node worker1 took the step and waits in all_reduce for it" in h.text, h.text
    assert (h.culprit, h.node) == ("Worker_TP0", "local")
    blind = assess(replace(cap, rings=()), work_pending=True, page=IDLE)
    assert blind.hypothesis.status is Status.CONTRADICTED, blind.hypothesis.reason
    assert "or never woke for its step (the ring was not read to tell)" in blind.cross_rank.reason


def test_two_nodes_diverged() -> None:
    cap, _ = load("diverged-two-nodes-0.25.1")
    f = assess(cap, work_pending=True, page=LOADED)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.DIVERGED, f.reason
    h = compose(f, cap)
    assert "Worker_TP0 waits in all_reduce and Worker_TP1 on node worker1 waits in barrier" in h.text, h.text


def test_readers_that_burned_cpu_between_the_captures_were_not_parked() -> None:
    """Recorded on vLLM 0.32.0 with every step's wake-up lost under load (the readers re-check every 5 s): both
    captures caught the readers in their poll, but each burned about 1 CPU s in the 2 s between them and the ring
    showed every block taken: they were taking steps. The daemon called that frozen; it is not shown parked."""
    cap, m = load("readers-spinning-0.32.0")
    assert m["stuck_kind"] == "parked"  # what the daemon said before this rule
    f = assess(cap, work_pending=True, page=LOADED)
    assert f.decision is Decision.UNDECIDED and "burned CPU between the captures" in f.reason, f.reason
