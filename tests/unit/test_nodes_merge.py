"""Two nodes between the evidence and the act stages. Merging other nodes' captures into the head's
(`watchdog.nodes.remote.merge`), then the decision on the result: a node whose stacks could not be taken, or that
answered with no engine rank, leaves ranks unread, so the capture is incomplete and the stacks cannot say "every rank
parked"; the head's own --native dumps survive the merge. The /dev/shm sweepers say what is stale even when removal
is refused, and an unreadable /dev/shm is an error, not "nothing stale". A node's log tail is bounded at load."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.facts import says
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
from watchdog.act.shm_sweep import LocalShm, NodeShm
from watchdog.config.nodes import MAX_LOG_LINES, NodeSection, check_nodes
from watchdog.core.processes import Capture, EngineProcess, Problem, ProcessId
from watchdog.core.roles import Role
from watchdog.core.types import Decision
from watchdog.evidence.explain.findings import PageWork, assess
from watchdog.nodes.remote import NodeCapture, merge
from watchdog.nodes.transport import NodeError

HEAD = (API, ENGINE, TP0)  # the head's processes; Worker_TP1 runs on the other node


def head_capture() -> Capture:
    r: Round = {API.pid: (API_FRAMES, "S", 1.0), ENGINE.pid: (ENGINE_WAITING, "S", 5.0),
                TP0.pid: (WORKER_IDLE, "S", 5.0)}
    return capture(r, dict(r), procs=HEAD)


def test_every_rank_parked_on_both_nodes_is_stuck() -> None:
    base = head_capture()
    # the other node's rank has the pid of the head's TP0 there: another process, known by its node and pid
    tp1 = EngineProcess(TP0.pid, Role.WORKER, "VLLM::Worker_TP1 on node worker1", {"TP": 1}, 1, node="worker1")
    node = NodeCapture("worker1", (tp1,), tuple({tp1.id: dump(tp1, WORKER_IDLE, t=t)} for t in (0.0, 3.0)))
    merged = merge(base, [node])
    assert merged.unseen_nodes == () and merged.complete
    assert [set(r) for r in merged.rounds] == [{*(p.id for p in HEAD), ProcessId("worker1", TP0.pid)}] * 2
    f = assess(merged, work_pending=True, page=PageWork(running=1, waiting=0))
    assert f.decision is Decision.STUCK, f.reason


def test_a_node_without_stacks_makes_the_capture_incomplete() -> None:
    base = head_capture()
    failed = NodeCapture("worker1", problems=(Problem("unreachable: no stacks: timed out", "worker1"),),
                         reachable=False, failed=True)
    merged = merge(base, [failed])
    assert merged.unseen_nodes == ("worker1",) and not merged.complete
    f = assess(merged, work_pending=True, page=PageWork(running=1, waiting=0))
    assert f.decision is Decision.UNDECIDED and not f.complete, f.reason
    assert says(f.reason, "no stacks", "worker1"), f.reason
    assert "node worker1: unreachable: no stacks: timed out" in f.problems
    # a node that answered with no engine process is not seen either: its ranks were not read (a wrong
    # process_prefix there, a container whose processes it cannot see), so the head's ranks alone decide nothing
    answered = NodeCapture("worker1", problems=(Problem("no engine process found", "worker1"),))
    f = assess(merge(base, [answered]), work_pending=True, page=PageWork(running=1, waiting=0))
    assert f.decision is Decision.UNDECIDED and says(f.reason, "no stacks", "worker1"), f.reason


def test_the_heads_native_dumps_survive_the_merge() -> None:
    base = head_capture()
    native = {TP0.id: dump(TP0, WORKER_IDLE)}
    merged = merge(replace(base, native=native), [NodeCapture("worker1")])
    assert merged.native == native


class RefusingLink:
    """A node link whose agent lists one stale segment and refuses to remove it (its agent.toml does not allow it)."""

    class node:
        name = "worker1"

    def call(self, verb: str, args: dict[str, object], timeout: float | None = None) -> dict[str, object]:
        assert verb == "shm"
        if args.get("remove"):
            raise NodeError("worker1", "refused", "shm: removing segments is not allowed by this node's config")
        return {"segments": [{"name": "psm_dead", "bytes": 4096, "in_use": False},
                             {"name": "psm_live", "bytes": 8, "in_use": True}]}


def test_a_refused_removal_still_names_what_is_stale() -> None:
    report = NodeShm(RefusingLink(), remove=True)()  # type: ignore[arg-type]
    assert report.stale == (("psm_dead", 4096),) and report.removed == () and report.in_use == 1
    assert "not removed" in report.error and "not allowed" in report.error, report.error


def test_a_shm_dir_that_cannot_be_listed_is_an_error_not_nothing_stale(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    report = LocalShm(remove=True, shm_dir=str(not_a_dir))()
    assert report.error.startswith(f"cannot list {not_a_dir}"), report
    assert LocalShm(remove=True, shm_dir=str(tmp_path / "absent"))().error == ""  # no /dev/shm: nothing in it


def test_a_log_tail_longer_than_an_agent_sends_is_a_config_error() -> None:
    ok = NodeSection(name="w1", host="h", identity_file="/k", known_hosts_file="/kh", log_lines=MAX_LOG_LINES)
    check_nodes((ok,))
    with pytest.raises(ValueError, match="log_lines 0 to 5000"):
        check_nodes((replace(ok, log_lines=MAX_LOG_LINES + 1),))
