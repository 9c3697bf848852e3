"""A data-parallel server's engines told apart: only an engine's own processes decide its suspicion (issue 31: a
worker of engine 0 in the model excused engine 1's stopped EngineCore_DP1, seen on the real CPU vLLM 0.32.0 with
``--data-parallel-size 2``: both workers titled plain ``VLLM::Worker``, told apart only by their parents)."""

from __future__ import annotations

from tests.unit.test_evidence_bundle import ENGINE_WAITING, WORKER_FORWARD, WORKER_IDLE, Frames, pyspy_json
from watchdog.core.processes import Capture, Dump, EngineProcess, ProcessId, ProcFacts
from watchdog.core.roles import Role
from watchdog.core.types import Decision
from watchdog.evidence.explain.engine_scope import engine_processes
from watchdog.evidence.explain.findings import assess

API = EngineProcess(200, Role.API_SERVER, "", {}, 1)
COORD = EngineProcess(201, Role.DP_COORDINATOR, "VLLM::DPCoordinator", {}, 200)
CORE0 = EngineProcess(210, Role.ENGINE_CORE, "VLLM::EngineCore_DP0", {"DP": 0}, 200)
CORE1 = EngineProcess(220, Role.ENGINE_CORE, "VLLM::EngineCore_DP1", {"DP": 1}, 200)
W0 = EngineProcess(211, Role.WORKER, "VLLM::Worker", {}, 210)  # as 0.32.0 titles them with TP=1
W1 = EngineProcess(221, Role.WORKER, "VLLM::Worker", {}, 220)
DP_TREE = (API, COORD, CORE0, CORE1, W0, W1)


def ids(*ps: EngineProcess) -> frozenset[ProcessId]:
    return frozenset(p.id for p in ps)


def test_a_tree_without_data_parallelism_is_one_engine() -> None:
    core = EngineProcess(10, Role.ENGINE_CORE, "VLLM::EngineCore", {}, 9)
    tp = EngineProcess(11, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0}, 10)
    assert engine_processes((core, tp), "0") is None
    assert engine_processes(DP_TREE, "") is None  # no engine named: all of them


def test_each_engine_has_its_core_and_the_workers_under_it() -> None:
    assert engine_processes(DP_TREE, "0") == ids(CORE0, W0)
    assert engine_processes(DP_TREE, "1") == ids(CORE1, W1)
    assert engine_processes(DP_TREE, "2") == frozenset()  # a page's engine with no process here: none decides


def test_a_worker_is_told_by_its_title_or_its_grandparent_and_kept_everywhere_when_neither_tells() -> None:
    titled = EngineProcess(230, Role.WORKER, "VLLM::Worker_DP1_TP1", {"DP": 1, "TP": 1}, 999)  # parent not known
    deeper = EngineProcess(231, Role.PROCESS, "VLLM::Helper", {}, 220)
    grandchild = EngineProcess(232, Role.WORKER, "VLLM::Worker", {}, 231)
    orphan = EngineProcess(240, Role.WORKER, "VLLM::Worker", {}, 999)
    tree = (*DP_TREE, titled, deeper, grandchild, orphan)
    assert engine_processes(tree, "1") == ids(CORE1, W1, titled, grandchild, orphan)
    assert engine_processes(tree, "0") == ids(CORE0, W0, orphan)


def test_parents_are_followed_on_their_own_node_only() -> None:
    # pid 220 on node b is not this host's EngineCore_DP1: b's worker under it is b's engine 0's
    b_core = EngineProcess(300, Role.ENGINE_CORE, "VLLM::EngineCore_DP0 on node b", {"DP": 0}, 1, node="b")
    b_worker = EngineProcess(220, Role.WORKER, "VLLM::Worker on node b", {}, 300, node="b")
    b_child = EngineProcess(301, Role.WORKER, "VLLM::Worker on node b", {}, 220, node="b")
    tree = (*DP_TREE, b_core, b_worker, b_child)
    assert engine_processes(tree, "0") == ids(CORE0, W0, b_core, b_worker, b_child)
    assert engine_processes(tree, "1") == ids(CORE1, W1)


def _dump(p: EngineProcess, frames: Frames, state: str, cpu: float, t: float) -> Dump:
    return Dump(p.pid, t, True, pyspy_json(p.pid, frames), nonblocking=state == "T",
                facts=ProcFacts(state, "", cpu, 4), seconds=0.2)


def stopped_core1() -> Capture:
    """Engine 0 in its model (TP=1: the worker runs the step), engine 1's EngineCore stopped mid-wait and its worker
    parked in its reader: two rounds 3 s apart, nothing of engine 1 moved."""
    rounds = []
    for i, t in enumerate((0.0, 3.0)):
        rounds.append({
            CORE0.id: _dump(CORE0, ENGINE_WAITING, "S", 5.0 + i, t),
            W0.id: _dump(W0, WORKER_FORWARD, "R", 20.0 + 3 * i, t),
            CORE1.id: _dump(CORE1, ENGINE_WAITING, "T", 7.0, t),
            W1.id: _dump(W1, WORKER_IDLE, "S", 9.0, t),
        })
    return Capture((CORE0, CORE1, W0, W1), tuple(rounds), (), {"rounds": 2, "gap_seconds": 3.0})


def test_engine_1_stopped_is_stuck_though_engine_0_works() -> None:
    cap = stopped_core1()
    one = assess(cap, work_pending=True, engine="1")
    assert one.decision is Decision.STUCK, one.reason
    assert one.cross_rank.culprit == "EngineCore_DP1", one.cross_rank.reason
    assert len(one.processes) == 4  # every process is still reported; only engine 1's decided
    zero = assess(cap, work_pending=True, engine="0")
    assert zero.decision is Decision.WORKING and "a long step" in zero.reason
    # unnamed (as before: every process counts), engine 0's step excuses engine 1: the defect this scope fixes
    assert assess(cap, work_pending=True).decision is Decision.WORKING
