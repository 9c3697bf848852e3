"""Merging other nodes' captures into the head's (`watchdog.nodes.remote.merge`), then the decision on the result:
a node whose stacks could not be taken at all leaves ranks unread, so the capture is incomplete and the stacks cannot
say "every rank parked"; the head's own --native dumps survive the merge."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.test_evidence_bundle import (
    API,
    API_FRAMES,
    ENGINE,
    ENGINE_WAITING,
    TP0,
    WORKER_IDLE,
    Round,
    capture,
    dump,
)
from watchdog.evidence.findings import PageWork, assess
from watchdog.evidence.model import Capture
from watchdog.nodes.remote import NodeCapture, merge
from watchdog.types import Decision

HEAD = (API, ENGINE, TP0)  # the head's processes; Worker_TP1 runs on the other node


def head_capture() -> Capture:
    r: Round = {API.pid: (API_FRAMES, "S", 1.0), ENGINE.pid: (ENGINE_WAITING, "S", 5.0),
                TP0.pid: (WORKER_IDLE, "S", 5.0)}
    return capture(r, dict(r), procs=HEAD)


def test_every_head_rank_parked_is_stuck_when_the_node_answered_with_its_ranks_parked_too() -> None:
    base = head_capture()
    alone = assess(base, work_pending=True, page=PageWork(running=1, waiting=0))
    assert alone.decision is Decision.STUCK, alone.reason


def test_a_node_without_stacks_makes_the_capture_incomplete() -> None:
    base = head_capture()
    failed = NodeCapture("worker1", problems=("node worker1 unreachable: no stacks: timed out",), reachable=False,
                         failed=True)
    merged = merge(base, [failed])
    assert merged.unseen_nodes == ("worker1",) and not merged.complete
    f = assess(merged, work_pending=True, page=PageWork(running=1, waiting=0))
    assert f.decision is Decision.UNDECIDED and not f.complete, f.reason
    assert "no stacks from node worker1" in f.reason, f.reason
    assert "node worker1 unreachable: no stacks: timed out" in f.problems
    # a node that answered with no engine process is not unseen: nothing of the engine runs there
    answered = NodeCapture("worker1", problems=("node worker1: no engine process found",))
    assert merge(base, [answered]).unseen_nodes == ()


def test_the_heads_native_dumps_survive_the_merge() -> None:
    base = head_capture()
    native = {TP0.pid: dump(TP0, WORKER_IDLE)}
    merged = merge(replace(base, native=native), [NodeCapture("worker1")])
    assert merged.native == native
