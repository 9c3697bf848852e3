"""The headline of a freeze (watchdog.evidence.explain.headline): who, what and why, from the cause down, and the
runbook of that cause. Real captures where they exist (tests/data/livelock: a livelock and an admission stall of the
CPU vLLM 0.32; tests/data/gpu-tp2: a two-H200 tensor-parallel hang), hand-made ones (vLLM 0.32's frames, as in
test_evidence_bundle) for a stopped rank, a peer gone, missing or on a node not seen, and every rank parked."""

from __future__ import annotations

import json
from dataclasses import replace

from tests.facts import clause_of, says
from tests.unit.livelock_data import load
from tests.unit.test_evidence_bundle import (
    API,
    API_FRAMES,
    ENGINE,
    ENGINE_WAITING,
    TP0,
    TP1,
    WORKER_ALLREDUCE,
    WORKER_FORWARD,
    WORKER_IDLE,
    Round,
    capture,
    dump,
    parked_round,
    stuck_capture,
)
from tests.unit.test_gpu_tp2 import WEDGE1, _views
from watchdog.core.processes import LOCAL, Capture, Dump, EngineProcess, Failure, Problem, ProcessId, ProcFacts
from watchdog.core.roles import Role
from watchdog.core.runbooks import Runbook
from watchdog.core.types import Decision
from watchdog.evidence.explain.findings import Findings, assess
from watchdog.evidence.explain.headline import GpuSaid, Headline, compose
from watchdog.evidence.gpu.culprit import gpu_culprit
from watchdog.evidence.gpu.ras_status import parse_ras
from watchdog.nodes.remote import NodeCapture, merge

HEAD = (API, ENGINE, TP0)  # the head's processes when Worker_TP1 runs on node worker1


def said(cap: Capture, **kw: object) -> tuple[Findings, Headline]:
    f = assess(cap, work_pending=True)
    return f, compose(f, cap, **kw)  # type: ignore[arg-type]


def first(text: str, *names: str) -> list[int]:
    """Where each name is first said: the headline runs from the cause down."""
    return [text.index(n) for n in names]


def stopped_round(tp1_state: str = "T") -> Round:
    return {API.pid: (API_FRAMES, "S", 1.0), ENGINE.pid: (ENGINE_WAITING, "S", 5.0),
            TP0.pid: (WORKER_ALLREDUCE, "R", 20.0), TP1.pid: (WORKER_FORWARD, tp1_state, 7.0)}


def head_round(tp0: list[tuple[str, str, int]] = WORKER_ALLREDUCE) -> Round:
    return {API.pid: (API_FRAMES, "S", 1.0), ENGINE.pid: (ENGINE_WAITING, "S", 5.0), TP0.pid: (tp0, "R", 20.0)}


def on_worker1(frames: list[tuple[str, str, int]] | None, state: str, failure: Failure | None = None) -> NodeCapture:
    """Worker_TP1 on node worker1, as its agent answered (keyed by its node and its pid there)."""
    tp1 = EngineProcess(103, Role.WORKER, "VLLM::Worker_TP1", {"TP": 1}, 1, node="worker1")
    rounds = tuple({tp1.id: replace(dump(tp1, frames, state, t=t), failure=failure)} for t in (0.0, 3.0))
    return NodeCapture("worker1", (tp1,), rounds)


# -- a stopped rank --------------------------------------------------------------------------------------------


def test_a_stopped_rank_is_said_first_then_who_waits_for_it() -> None:
    f, h = said(stuck_capture())
    assert f.decision is Decision.STUCK  # the decision is findings', unchanged
    assert h.runbook is Runbook.STOPPED_RANK and (h.culprit, h.node) == ("Worker_TP1", "local")
    assert says(clause_of(h.text, "Worker_TP1"), "stopped", "SIGSTOP"), h.text
    assert says(clause_of(h.text, "Worker_TP0"), "waits", "all_reduce"), h.text
    assert says(clause_of(h.text, "EngineCore"), "waits", "both"), h.text
    assert first(h.text, "Worker_TP1", "Worker_TP0", "EngineCore") == sorted(first(h.text, "Worker_TP1", "Worker_TP0",
                                                                                       "EngineCore")), h.text
    assert h.text.startswith("Worker_TP1") and "every rank parked" not in h.text


def test_a_rank_held_by_a_debugger_says_so() -> None:
    _, h = said(capture(stopped_round("t"), stopped_round("t")))
    assert h.runbook is Runbook.STOPPED_RANK and says(clause_of(h.text, "Worker_TP1"), "debugger", "tracing stop")


def test_a_stopped_rank_on_the_other_node_names_the_node() -> None:
    base = capture(head_round(), head_round(), procs=HEAD)
    f, h = said(merge(base, [on_worker1(WORKER_FORWARD, "T")]))
    assert f.decision is Decision.STUCK, f.reason
    assert h.runbook is Runbook.STOPPED_RANK and (h.culprit, h.node) == ("Worker_TP1", "worker1")
    assert says(clause_of(h.text, "Worker_TP1"), "node", "worker1", "stopped"), h.text
    assert says(clause_of(h.text, "Worker_TP0"), "all_reduce") and h.text.startswith("Worker_TP1"), h.text


def test_many_ranks_doing_the_same_are_counted_with_their_nodes_not_listed() -> None:
    """Eight nodes of two ranks, one stopped: the other fifteen are one clause, counted, the first two and the last
    named; the culprit and its node first, as with two ranks."""
    caps = []
    for k in range(8):
        ranks = [EngineProcess(200 + r, Role.WORKER, f"VLLM::Worker_TP{r}", {"TP": r}, 1, node=f"node{k}")
                 for r in (2 * k, 2 * k + 1)]
        state = {p.pid: "T" if p.ranks["TP"] == 13 else "S" for p in ranks}
        rounds = tuple({p.id: dump(p, WORKER_IDLE, state[p.pid], t=t) for p in ranks} for t in (0.0, 3.0))
        caps.append(NodeCapture(f"node{k}", tuple(ranks), rounds))
    base = capture(head_round(), head_round(), procs=HEAD)
    f, h = said(merge(base, caps))
    assert f.decision is Decision.STUCK, f.reason
    assert (h.culprit, h.node) == ("Worker_TP13", "node6") and h.text.startswith("Worker_TP13 on node node6"), h.text
    assert "15 processes on 8 nodes (Worker_TP0 on node node0, Worker_TP1 on node node0 ... Worker_TP15 on node " \
           "node7)" in h.text, h.text
    assert "Worker_TP7 " not in h.text and len(h.text) < 400, h.text


# -- a collective waiting on a peer: gone, missing, not seen, idle -----------------------------------------------


def test_a_peer_gone_on_this_node() -> None:
    rnd = stopped_round()
    cap = capture(rnd, rnd)
    gone = Dump(TP1.pid, 0.0, False, "", "the process exited", facts=ProcFacts("Z", "", 7.0, 1),
                failure=Failure.GONE)
    cap = replace(cap, rounds=tuple({**r, TP1.id: gone} for r in cap.rounds))
    f, h = said(cap)
    assert f.decision is Decision.UNDECIDED  # a rank not read: the metric window decides, the headline still says
    assert h.runbook is Runbook.PEER_WAIT and h.culprit == "Worker_TP1"
    assert says(clause_of(h.text, "Worker_TP1"), "gone", "exited"), h.text
    assert says(clause_of(h.text, "Worker_TP0"), "waits", "all_reduce"), h.text


def test_a_peer_gone_on_the_other_node() -> None:
    base = capture(head_round(), head_round(), procs=HEAD)
    _, h = said(merge(base, [on_worker1(None, "Z", Failure.GONE)]))
    assert h.runbook is Runbook.PEER_WAIT and (h.culprit, h.node) == ("Worker_TP1", "worker1")
    assert says(clause_of(h.text, "Worker_TP1"), "node", "worker1", "gone"), h.text


def test_a_peer_missing_from_the_processes() -> None:
    tp2 = EngineProcess(104, Role.WORKER, "VLLM::Worker_TP2", {"TP": 2}, ENGINE.pid)
    rnd = head_round()
    cap = capture(rnd, rnd, procs=HEAD)
    cap = replace(cap, processes=(*HEAD, tp2),
                  rounds=tuple({**r, tp2.id: dump(tp2, WORKER_ALLREDUCE, "R", 20.0, t=r[TP0.id].t)}
                               for r in cap.rounds))
    _, h = said(cap)
    assert h.runbook is Runbook.PEER_WAIT and h.culprit is None
    assert says(h.text, "Worker_TP0", "Worker_TP2", "all_reduce", "Worker_TP1", "not among"), h.text


def test_a_peer_on_a_node_whose_stacks_could_not_be_taken() -> None:
    base = capture(head_round(), head_round(), procs=HEAD)
    failed = NodeCapture("worker1", problems=(Problem("unreachable: no stacks: timed out", "worker1"),),
                         reachable=False, failed=True)
    cap = merge(base, [failed])
    f, h = said(cap)
    assert f.decision is Decision.UNDECIDED
    assert h.runbook is Runbook.PEER_WAIT
    assert says(clause_of(h.text, "Worker_TP0"), "all_reduce", "node", "worker1", "could not be taken"), h.text


def test_a_node_not_seen_with_no_rank_in_a_collective_is_the_blind_node_page() -> None:
    base = capture(head_round(WORKER_IDLE), head_round(WORKER_IDLE), procs=HEAD)
    failed = NodeCapture("worker1", problems=(Problem("unreachable", "worker1"),), reachable=False, failed=True)
    _, h = said(merge(base, [failed]))
    assert h.runbook is Runbook.BLIND_NODE and says(h.text, "no stacks", "worker1"), h.text


def test_a_peer_back_in_its_idle_loop_is_blamed_for_skipping_the_collective() -> None:
    rnd = {**stopped_round(), TP1.pid: (WORKER_IDLE, "S", 7.0)}
    f, h = said(capture(rnd, rnd))
    assert f.cross_rank.culprit == "Worker_TP1"
    assert h.runbook is Runbook.PEER_WAIT and h.culprit == "Worker_TP1"
    assert says(clause_of(h.text, "Worker_TP1"), "idle", "collective"), h.text
    assert says(clause_of(h.text, "Worker_TP0"), "all_reduce") and h.text.startswith("Worker_TP1"), h.text


# -- a rank waiting on its own GPU: the real two-H200 hang ----------------------------------------------------


def wedge1() -> Capture:
    """The recorded bundle's two rounds of every process, with its /proc states and CPU between the rounds."""
    m = json.loads((WEDGE1 / "manifest.json").read_text())
    procs = tuple(EngineProcess(p["pid"], Role(p["role"]), p["title"], dict(p["ranks"])) for p in m["processes"])
    rounds = tuple({ProcessId(LOCAL, p["pid"]): Dump(p["pid"], 3.0 * i, True,
                                   next(WEDGE1.glob(f"dumps/round{i}-{p['pid']}-*.json")).read_text(),
                                   facts=ProcFacts(p["state"], "", (i - 1) * p["cpu_seconds_between_captures"], 4))
                    for p in m["processes"]} for i in (1, 2))
    return Capture(procs, rounds)


def test_the_real_gpu_hang_from_the_stacks_alone() -> None:
    f, h = said(wedge1())
    assert f.cross_rank.culprit is None  # the stack classes alone blame nobody: "every rank parked" before
    assert h.runbook is Runbook.GPU_WAIT and h.culprit == "Worker_TP1"
    assert says(clause_of(h.text, "Worker_TP1"), "own GPU", "cuCtxSynchronize_v2"), h.text
    assert h.text.startswith("Worker_TP1") and "Worker_TP0" in h.text, h.text


def test_the_real_gpu_hang_with_power_and_nccl_ras() -> None:
    views = _views(WEDGE1)
    c = gpu_culprit(views, parse_ras((WEDGE1 / "nccl-ras.txt").read_text()))
    gpu = GpuSaid(c.culprit, c.sources, {v.name: v.gpu.value for v in views if v.gpu is not None})
    _, h = said(wedge1(), gpu=gpu)
    assert h.runbook is Runbook.GPU_WAIT and h.culprit == "Worker_TP1"
    assert says(clause_of(h.text, "Worker_TP1"), "own GPU", "idle power", "nccl_ras"), h.text
    busy = replace(gpu, states={"Worker_TP1": "working"})  # a GPU busy at full power: a long or endless kernel
    _, h = said(wedge1(), gpu=busy)
    assert h.runbook is Runbook.GPU_WAIT and says(clause_of(h.text, "Worker_TP1"), "full power"), h.text


# -- every rank parked, the loop's own faults, no stacks ------------------------------------------------------


def test_every_rank_parked_with_nobody_to_blame_gives_the_hypothesis() -> None:
    r = parked_round()
    f, h = said(capture(r, r, procs=(ENGINE, TP0, TP1)))
    assert f.decision is Decision.STUCK and f.cross_rank.culprit is None
    assert h.runbook is Runbook.ALL_PARKED and h.culprit is None
    assert says(h.text, "every rank", "parked", "no rank to blame", "poll-parking", "SUPPORTED"), h.text
    assert says(h.text, "EngineCore", "Worker_TP0", "Worker_TP1", "readers"), h.text


def test_the_real_livelock() -> None:
    cap, page, _ = load("livelock")
    f = assess(cap, work_pending=True, page=page)
    h = compose(f, cap)
    assert h.runbook is Runbook.LIVELOCK and h.culprit == "EngineCore"
    assert h.text.startswith("livelock: EngineCore turns its own loop"), h.text  # what the engine tests pin
    assert says(clause_of(h.text, "Worker_TP0"), "Worker_TP1", "readers"), h.text


def test_the_real_admission_stall() -> None:
    cap, page, _ = load("admission_stall")
    f = assess(cap, work_pending=True, page=page)
    h = compose(f, cap)
    assert h.runbook is Runbook.ADMISSION_STALL and h.culprit == "EngineCore"
    assert says(h.text, "admission stall", "running=0", "waiting=1"), h.text


def test_no_stacks_leaves_the_metric_window_s_word_first() -> None:
    rnd: Round = {ENGINE.pid: (None, "S", 5.0), TP0.pid: (None, "S", 20.0), TP1.pid: (None, "S", 20.0)}
    cap = capture(rnd, rnd, procs=(ENGINE, TP0, TP1))
    f = assess(cap, work_pending=True)
    h = compose(f, cap, verdict="no progress for 40s (running=2 waiting=0)")
    assert f.decision is Decision.UNDECIDED and h.runbook is Runbook.FROZEN
    assert h.text.startswith("no progress for 40s") and says(h.text, "could not say why", "boom"), h.text
    assert compose(f, cap).text.startswith("the stacks could not say why"), compose(f, cap).text


def test_stacks_that_show_work_say_so() -> None:
    r: Round = {ENGINE.pid: (ENGINE_WAITING, "S", 5.0), TP0.pid: (WORKER_FORWARD, "R", 20.0),
                TP1.pid: (WORKER_FORWARD, "R", 20.0)}
    f, h = said(capture(r, r, procs=(ENGINE, TP0, TP1)))
    assert f.decision is Decision.WORKING and h.runbook is Runbook.FROZEN and says(h.text, "work", "not a freeze")


def test_every_cause_has_its_own_page() -> None:
    """Each cause above names a page of its own (the pages' files: tests/unit/test_runbooks.py)."""
    pages = {said(stuck_capture())[1].runbook, compose(*_real("livelock")).runbook,
             compose(*_real("admission_stall")).runbook, said(wedge1())[1].runbook,
             said(capture(parked_round(), parked_round(), procs=(ENGINE, TP0, TP1)))[1].runbook}
    assert pages == {Runbook.STOPPED_RANK, Runbook.LIVELOCK, Runbook.ADMISSION_STALL, Runbook.GPU_WAIT,
                     Runbook.ALL_PARKED}


def _real(fault: str) -> tuple[Findings, Capture]:
    cap, page, _ = load(fault)
    return assess(cap, work_pending=True, page=page), cap
