"""Known vLLM hangs (watchdog/evidence/explain/known_hangs.py): matched on the evidence only, said against the engine's
own version, and said everywhere the operator reads: the headline (summary.md, the manifest, the verdict's reason),
the manifest's known_hang, the evidence_captured alert and the upstream report.

The lost wake-up's positive case is composed from real frames: EngineCore waiting on its workers' reply (the recorded
stopped-worker capture of each version) beside workers parked in their reader (the recorded idle capture of the same
version). The no-match cases are the recorded captures as they are.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.livelock_data import load
from tests.unit.test_evidence_bundle import (
    ENGINE,
    ENGINE_WAITING,
    MPX,
    SITE,
    TP0,
    TP1,
    WORKER_IDLE,
    Round,
    capture,
    context,
    incident,
    parked_round,
)
from tests.unit.test_headline_reach import Runner, harness
from watchdog.core.processes import Capture
from watchdog.core.ring import Ring, RingBlock
from watchdog.core.roles import Role
from watchdog.core.types import State, Transition
from watchdog.evidence.bundle.coordinator import EvidenceCoordinator
from watchdog.evidence.bundle.investigate import Evidence, EvidenceDone, EvidenceJob
from watchdog.evidence.bundle.upstream import BundleFiles, Redaction, render
from watchdog.evidence.bundle.write import said_of, write_bundle
from watchdog.evidence.explain import known_hangs as kh
from watchdog.evidence.explain.findings import PageWork, assess
from watchdog.evidence.explain.headline import compose

DATA = Path(__file__).resolve().parents[1] / "data"
LOST_025 = ("known hang: the lost wake-up fixed by vLLM #45224 in 0.27.0; this engine runs 0.25.1+cpu: upgrade to "
            "0.27.0 or later")
LOST_032 = ("known hang: not the lost wake-up fixed by vLLM #45224 in 0.27.0: this engine runs 0.32.0+cpu, which has "
            "the fix (0.27.0+ re-checks every 5 s: a parked reader that stays parked is not the lost wake-up #45224 "
            "fixed); a new hang, worth reporting upstream")
LOST_UNKNOWN = ("known hang: the lost wake-up fixed by vLLM #45224 in 0.27.0; this engine's vLLM version was not "
                "read: if older than 0.27.0, upgrade to 0.27.0 or later")


def recorded(version: str, case: str) -> Capture:
    return load(case, DATA / "versions" / f"vllm-{version}")[0]


def lost_wakeup(version: str) -> Capture:
    """Real frames of ``version``: EngineCore in a step waiting on the reply, both workers parked in their reader."""
    busy, idle = recorded(version, "stopped_worker"), recorded(version, "idle")
    engine = next(p for p in busy.processes if p.role == Role.ENGINE_CORE)
    workers = [p for p in idle.processes if p.role == Role.WORKER]
    rounds = tuple({engine.id: b[engine.id], **{w.id: i[w.id] for w in workers}}
                   for b, i in zip(busy.rounds, idle.rounds, strict=True))
    return Capture((engine, *workers), rounds)


def ring(*blocks: RingBlock, error: str = "") -> Ring:
    return Ring("psm_ab12", writer="VLLM::EngineCore", readers=("VLLM::Worker_TP0", "VLLM::Worker_TP1"),
                max_chunks=len(blocks), blocks=blocks, error=error)


# -- versions ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "fixed"), [
    ("0.25.1", False), ("0.25.1+cpu", False), ("0.26.0", False), ("0.27.0rc1", False), ("0.27.0.dev12+g1a2b", False),
    ("0.27.0", True), ("0.27.0+cpu", True), ("0.27", True), ("v0.32.0", True), ("0.32.0+cpu", True),
    ("0.100.0", True), ("1.0.0", True), ("0.27.0.post1", True),
])
def test_versions_compare_as_releases(version: str, fixed: bool) -> None:
    assert kh.has_fix(version, "0.27.0") is fixed


@pytest.mark.parametrize("version", ["", "unknown", "dev", "  "])
def test_a_version_not_read_is_not_guessed(version: str) -> None:
    assert kh.version_key(version) is None and kh.has_fix(version, "0.27.0") is None


# -- the lost wake-up, each version side -------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "said", "status"), [
    ("0.25.1", LOST_025, "affected"), ("0.32.0", LOST_032, "fixed")])
def test_the_lost_wake_up_on_real_frames_each_side_of_the_fix(version: str, said: str, status: str) -> None:
    cap = lost_wakeup(version)
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    [m] = kh.match(f, cap, "", f"{version}+cpu")
    assert (m.hang.id, m.status, m.clause) == ("lost_wakeup", status, said)
    assert "the broadcast ring was not read: the stacks alone" in m.seen
    headline = kh.with_clause(compose(f, cap).text, kh.match(f, cap, "", f"{version}+cpu"))
    assert headline.startswith("every rank is parked") and headline.endswith(f"; {said}"), headline


def test_the_lost_wake_up_with_the_version_not_read() -> None:
    cap = lost_wakeup("0.25.1")
    [m] = kh.match(assess(cap, work_pending=True, page=PageWork(4, 0)), cap)
    assert (m.status, m.clause) == ("version_unknown", LOST_UNKNOWN)
    assert m.to_json()["engine_version"] is None and m.to_json()["fixed_in"] == "0.27.0"


def test_an_unread_block_of_a_parked_reader_is_said_and_a_ring_all_read_rules_it_out() -> None:
    cap = lost_wakeup("0.25.1")
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    unread = replace(cap, rings=(ring(RingBlock(0, True, (True, True)), RingBlock(1, True, (True, False))),))
    [m] = kh.match(f, unread, "", "0.25.1")
    assert "block 1 of psm_ab12 written, unread by VLLM::Worker_TP1" in m.seen and m.clause == LOST_025.replace(
        "0.25.1+cpu", "0.25.1")
    all_read = replace(cap, rings=(ring(RingBlock(0, True, (True, True)), RingBlock(1, False, (False, False))),))
    assert kh.match(f, all_read, "", "0.25.1") == ()  # every written block was taken: no wake-up was lost
    unreadable = replace(cap, rings=(ring(error="no layout for vllm 0.20.0"),))
    assert [m.hang.id for m in kh.match(f, unreadable, "", "0.25.1")] == ["lost_wakeup"]


def test_the_verdict_that_read_the_ring_matches_with_its_headline() -> None:
    """The findings read the ring too (StuckKind lost_wakeup): the clause ends that verdict's own headline."""
    cap = replace(lost_wakeup("0.25.1"), rings=(ring(RingBlock(0, True, (True, True)),
                                                     RingBlock(1, True, (True, False))),))
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    [m] = kh.match(f, cap, "", "0.25.1+cpu")
    assert (m.hang.id, m.clause) == ("lost_wakeup", LOST_025)
    assert kh.with_clause(compose(f, cap).text, (m,)).endswith(f"; {LOST_025}")


def test_the_ring_reader_s_version_serves_when_the_bundle_has_none() -> None:
    cap = lost_wakeup("0.25.1")
    f = assess(cap, work_pending=True, page=PageWork(4, 0))  # the stacks' findings; the ring read beside them
    read = replace(cap, rings=(replace(ring(RingBlock(0, True, (False, True))), version="0.25.1+cpu"),))
    [m] = kh.match(f, read)
    assert (m.version, m.status, m.clause) == ("0.25.1+cpu", "affected", LOST_025)


def test_no_work_pending_is_not_the_lost_wake_up() -> None:
    cap = lost_wakeup("0.25.1")
    assert kh.match(assess(cap, work_pending=False, page=PageWork(0, 0)), cap, "", "0.25.1") == ()


# -- no match on the recorded real captures ---------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.25.1", "0.32.0"])
@pytest.mark.parametrize(("case", "pending"), [("idle", False), ("stopped_worker", True)])
def test_no_known_hang_in_the_recorded_captures(version: str, case: str, pending: bool) -> None:
    cap = recorded(version, case)
    f = assess(cap, work_pending=pending)
    log = f"INFO shm_broadcast.py:1] {kh.RING_LINE}. This typically happens when some processes are hanging\n" * 3
    assert kh.match(f, cap, log, version) == ()  # a stopped worker explains EngineCore's wait: no vLLM bug
    assert kh.with_clause("x", ()) == "x" and kh.manifest_entry(()) is None and kh.said(None) == kh.NO_MATCH


@pytest.mark.parametrize("fault", ["livelock", "admission_stall"])
def test_no_known_hang_in_the_recorded_livelock_and_admission_stall(fault: str) -> None:
    cap, page, _ = load(fault)
    assert kh.match(assess(cap, work_pending=True, page=page), cap, "", "0.32.0") == ()


# -- the other entries ------------------------------------------------------------------------------------------

ZMQ_RECV = [("Socket.poll", f"{SITE}/zmq/sugar/socket.py", 1040),
            ("MessageQueue.recv", f"{SITE}/vllm/distributed/device_communicators/shm_broadcast.py", 880),
            ("MessageQueue.dequeue", f"{SITE}/vllm/distributed/device_communicators/shm_broadcast.py", 780),
            *ENGINE_WAITING[5:]]
WRITER = [("MessageQueue.acquire_write", f"{SITE}/vllm/distributed/device_communicators/shm_broadcast.py", 600),
          ("_GeneratorContextManager.__enter__", "/usr/lib/python3.12/contextlib.py", 137),
          ("MessageQueue.enqueue", f"{SITE}/vllm/distributed/device_communicators/shm_broadcast.py", 640),
          ("MultiprocExecutor.collective_rpc", MPX, 360), *ENGINE_WAITING[8:]]


def test_the_negative_rpc_timeout_signature_each_side_of_the_clamp() -> None:
    rnd: Round = {ENGINE.pid: (ZMQ_RECV, "S", 5.0), TP0.pid: (WORKER_IDLE, "S", 20.0),
                  TP1.pid: (WORKER_IDLE, "S", 20.0)}
    cap = capture(rnd, rnd, procs=(ENGINE, TP0, TP1))
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    ids = [m.hang.id for m in kh.match(f, cap, "", "0.25.1")]
    assert "negative_rpc_timeout" in ids, ids
    m = next(m for m in kh.match(f, cap, "", "0.25.1") if m.hang.id == "negative_rpc_timeout")
    assert m.clause == ("known hang: the negative RPC timeout fixed by vLLM #40926, #41357 in 0.27.0; this engine "
                        "runs 0.25.1: upgrade to 0.27.0 or later")
    new = next(m for m in kh.match(f, cap, "", "0.32.0") if m.hang.id == "negative_rpc_timeout")
    assert new.status == "fixed" and "clamps the timeout (#41357)" in new.clause
    # the local reply path (the shared-memory reader) is not that signature
    plain = capture(parked_round(), parked_round(), procs=(ENGINE, TP0, TP1))
    assert "negative_rpc_timeout" not in [m.hang.id for m in kh.match(assess(plain, True), plain, "", "0.25.1")]


def test_a_writer_spinning_after_a_worker_died_is_open_upstream() -> None:
    rnd: Round = {ENGINE.pid: (WRITER, "R", 5.0), TP0.pid: (WORKER_IDLE, "S", 20.0), TP1.pid: (WORKER_IDLE, "Z", 20.0)}
    cap = capture(rnd, {**rnd, ENGINE.pid: (WRITER, "R", 8.0)}, procs=(ENGINE, TP0, TP1))
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    [m] = kh.match(f, cap, "", "0.32.0")
    assert m.hang.id == "writer_spins_after_worker_death" and m.status == "open"
    assert m.clause.startswith("known hang: the writer spinning in acquire_write after a worker died (vLLM #45644): "
                               "open upstream (not fixed as of 0.34.0)"), m.clause
    alive = capture({**rnd, TP1.pid: (WORKER_IDLE, "S", 20.0)}, {**rnd, TP1.pid: (WORKER_IDLE, "S", 20.0)},
                    procs=(ENGINE, TP0, TP1))
    assert "writer_spins_after_worker_death" not in [m.hang.id for m in kh.match(assess(alive, True), alive)]


def test_the_60_s_line_means_engine_core_waited_on_a_worker_and_is_open() -> None:
    cap = lost_wakeup("0.25.1")
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    log = f"(EngineCore pid=1) INFO shm_broadcast.py:1] {kh.RING_LINE}.\n" * 2 + \
        "TimeoutError: RPC call to sample_tokens timed out.\n"
    first, also = kh.match(f, cap, log, "0.25.1")
    assert first.hang.id == "lost_wakeup" and also.hang.id == "worker_hung_in_step" and also.status == "open"
    assert any("2 times in the log tail: EngineCore waited over 60 s for a worker's reply" in s for s in also.seen)
    assert "RPC call to sample_tokens timed out, in the log tail" in also.seen
    assert "open upstream (not fixed as of 0.34.0)" in also.clause and "#40926, #41530" in also.clause
    entry = kh.manifest_entry((first, also))
    assert entry is not None and [a["id"] for a in entry["also"]] == ["worker_hung_in_step"]
    idle = recorded("0.32.0", "idle")  # EngineCore idle now: old lines (a compile, a load) say nothing
    assert kh.match(assess(idle, work_pending=False), idle, log, "0.32.0") == ()


# -- said everywhere --------------------------------------------------------------------------------------------


def test_the_bundle_says_it_in_its_headline_summary_and_manifest(tmp_path: Path) -> None:
    cap = lost_wakeup("0.25.1")
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    path = write_bundle(tmp_path, incident(1_760_000_000.0), cap, f, context(versions={"vllm": "0.25.1+cpu"}))
    m = json.loads((path / "manifest.json").read_text())
    assert m["headline"].endswith(f"; {LOST_025}"), m["headline"]
    k = m["known_hang"]
    assert (k["id"], k["fixed_in"], k["engine_version"], k["status"]) == ("lost_wakeup", "0.27.0", "0.25.1+cpu",
                                                                          "affected")
    assert k["sources"] == ["vLLM PR #45224: shm_broadcast: bound idle reader waits and release read slots"]
    assert k["advice"] == "this engine runs 0.25.1+cpu: upgrade to 0.27.0 or later"
    text = (path / "summary.md").read_text()
    assert f"**{m['headline']}**" in text
    assert f"- known vLLM hang: {LOST_025.removeprefix('known hang: ')} (sources: vLLM PR #45224" in text
    assert said_of(path)[0] == m["headline"]
    report = render(BundleFiles(m["id"], m), Redaction(), "0.1.0")
    assert f"- known vLLM hang: {LOST_025.removeprefix('known hang: ')} (sources: vLLM PR #45224" in report


def test_no_match_is_said_as_no_match(tmp_path: Path) -> None:
    cap = recorded("0.32.0", "stopped_worker")
    path = write_bundle(tmp_path, incident(1_760_000_000.0), cap, assess(cap, work_pending=True), context())
    m = json.loads((path / "manifest.json").read_text())
    assert m["known_hang"] is None and m["known_hang_said"] == kh.NO_MATCH and "known hang" not in m["headline"]
    assert f"- known vLLM hang: {kh.NO_MATCH}" in (path / "summary.md").read_text()
    assert f"- known vLLM hang: {kh.NO_MATCH}" in render(BundleFiles(m["id"], m), Redaction(), "0.1.0")


def test_the_verdict_reason_and_the_evidence_captured_alert_carry_it(tmp_path: Path) -> None:
    cap = lost_wakeup("0.32.0")
    f = assess(cap, work_pending=True, page=PageWork(4, 0))
    runner = Runner()
    coord = EvidenceCoordinator(runner, 40.0)
    coord.on_transition(Transition(1.0, "0", State.WORKING, State.SUSPECT, "no progress for 5s"), 1.0)
    runner.done.append(EvidenceDone(EvidenceJob("0", "suspect", "x", False, 1.0), 1.0,
                                    Evidence(cap, f, 2.0, "0.32.0+cpu"), None))
    [out] = coord.collect(4.0)
    obs = out.observation
    assert obs is not None and obs.reason.endswith(f"; {LOST_032}"), obs
    bundle = write_bundle(tmp_path / "incidents", incident(1_760_000_000.0), cap, f,
                          context(versions={"vllm": "0.32.0+cpu"}))
    runner.done.append(EvidenceDone(EvidenceJob("0", "frozen", "x", True, 1.0, "inc-1"), 1.0,
                                    Evidence(cap, f, 2.0), bundle, said=said_of(bundle)))
    [out] = coord.collect(5.0)
    assert out.incident is not None
    h = harness(tmp_path)
    h.step(State.FROZEN, reason="no progress for 40s (running=4 waiting=0)")
    h.r.evidence("0", "stuck", str(bundle), out.incident.details)
    assert h.alerts[-1].event == "evidence_captured" and h.alerts[-1].summary.endswith(f"; {LOST_032}")
