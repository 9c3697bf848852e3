"""From a capture to findings: each process explained, whether it moved, who is to blame, and what the
judgement should do with the suspicion (confirm it, clear it, or leave it to the metric window).

Pure: it reads a Capture (two rounds of py-spy JSON with /proc facts) and returns data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from watchdog.evidence.explain import (
    Cls,
    CrossRankVerdict,
    HypothesisVerdict,
    ProcessExplanation,
    classify,
    cross_rank,
    poll_parking,
)
from watchdog.evidence.model import Capture, Dump, EngineProcess
from watchdog.evidence.roles import ENGINE_ROLES, Role
from watchdog.evidence.stacks import Frame, ProcessStack, StackParseError, parse_pyspy_json
from watchdog.types import Decision

_WORKING = {Cls.MODEL_FORWARD, Cls.COMPILE}  # a rank doing real work: the silence is a long step
# Waiting loops move between their own lines (spin, poll with a timeout, re-check): that is not progress.
_WAITING = {Cls.IDLE_READER_WAIT, Cls.ENGINE_IDLE, Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING,
            Cls.STOPPED}


@dataclass(frozen=True, slots=True)
class ProcessFinding:
    process: EngineProcess
    explanation: ProcessExplanation | None  # None when no dump could be read
    moved: bool | None  # deciding frames differ between the two captures (None: not two good captures)
    cpu_seconds: float | None  # CPU used between the captures
    state: str  # /proc state at the first capture
    error: str  # why there is no explanation


@dataclass(frozen=True, slots=True)
class Findings:
    processes: tuple[ProcessFinding, ...]
    cross_rank: CrossRankVerdict
    hypothesis: HypothesisVerdict
    decision: Decision
    reason: str
    complete: bool
    problems: tuple[str, ...]


def _stack(dump: Dump, proc: EngineProcess) -> ProcessStack | None:
    if not dump.ok:
        return None
    try:
        return parse_pyspy_json(json.loads(dump.output), pid=proc.pid, title=proc.title)
    except (ValueError, StackParseError):
        return None


def _frames_key(frames: tuple[Frame, ...]) -> tuple[tuple[str, str, int | None], ...]:
    return tuple((f.function, f.file, f.line) for f in frames)


def _thread_frames(ps: ProcessStack, label: str) -> tuple[Frame, ...]:
    """The frames of the thread an explanation names (by name, or "thread <id>" for unnamed ones)."""
    for t in ps.threads:
        if label in (t.name, f"thread {t.thread_id}"):
            return t.frames
    return ()


def assess(capture: Capture, work_pending: bool | None) -> Findings:
    found: list[ProcessFinding] = []
    for proc in capture.processes:
        dumps = [r[proc.pid] for r in capture.rounds if proc.pid in r]
        first = dumps[0] if dumps else None
        stacks = [_stack(d, proc) for d in dumps]
        state = first.facts.state if first and first.facts else "?"
        if not stacks or stacks[0] is None:
            error = first.error if first and first.error else "the dump could not be read"
            found.append(ProcessFinding(proc, None, None, None, state, error))
            continue
        expl = classify(stacks[0], proc.role, state)
        moved: bool | None = None
        cpu: float | None = None
        if len(stacks) >= 2 and stacks[-1] is not None:
            moved = _frames_key(_thread_frames(stacks[0], expl.thread)) != _frames_key(
                _thread_frames(stacks[-1], expl.thread))
            if moved and expl.cls in _WAITING:
                # a wait loop passes through its own lines; only leaving the wait is progress
                moved = classify(stacks[-1], proc.role, dumps[-1].facts.state
                                 if dumps[-1].facts else None).cls != expl.cls
            last = dumps[-1].facts
            if first and first.facts and last:
                cpu = round(last.cpu_seconds - first.facts.cpu_seconds, 3)
        error = ""
        if len(capture.rounds) >= 2 and moved is None:  # unknown whether it moved: the capture is incomplete
            error = (dumps[-1].error if len(dumps) >= 2 else "") or "no readable dump in the last round"
        found.append(ProcessFinding(proc, expl, moved, cpu, state, error))
    expls = [f.explanation for f in found if f.explanation is not None]
    moved_by_name = {f.explanation.name: bool(f.moved) for f in found if f.explanation is not None}
    engine_procs = [f for f in found if f.process.role in ENGINE_ROLES]
    two_rounds = len(capture.rounds) >= 2
    any_moved = any(f.moved for f in engine_procs) if two_rounds else None
    cross = cross_rank(expls, moved_by_name if two_rounds else None)
    hypothesis = poll_parking([e for e in expls if e.role in (Role.ENGINE_CORE, Role.WORKER)], work_pending, any_moved)
    complete = bool(engine_procs) and all(not f.error for f in engine_procs)
    decision, reason = _decide(engine_procs, complete, two_rounds, cross)
    return Findings(tuple(found), cross, hypothesis, decision, reason, complete, capture.problems)


def _unread(procs: list[ProcessFinding]) -> str:
    """Which processes could not be read and why, each cause (with its fix) once: "ptrace was denied...: TP0, TP1"."""
    by_error: dict[str, list[str]] = {}
    for f in procs:
        if f.error:
            by_error.setdefault(f.error, []).append(f.process.label)
    return "; ".join(f"{', '.join(labels)}: {error}" for error, labels in by_error.items())


def _decide(procs: list[ProcessFinding], complete: bool, two_rounds: bool,
            cross: CrossRankVerdict) -> tuple[Decision, str]:
    """Stacks confirm a freeze only when every engine process was read and nothing moved between captures."""
    working = [f for f in procs if f.explanation is not None and f.explanation.cls in _WORKING]
    if working:
        e = working[0].explanation
        assert e is not None
        return Decision.WORKING, f"{e.name} is {e.cls.value}: a long step, not a freeze"
    movers = [f for f in procs if f.moved and f.explanation is not None]
    if movers:
        names = ", ".join(f.explanation.name for f in movers if f.explanation)
        return Decision.WORKING, f"stacks moved between captures ({names})"
    if not procs:
        return Decision.UNDECIDED, "no engine process found to take stacks of"
    if not complete:
        return Decision.UNDECIDED, f"incomplete capture ({_unread(procs)})"
    if not two_rounds:
        return Decision.UNDECIDED, "a single capture cannot tell parked from passing through"
    culprit = f"; culprit: {cross.culprit}" if cross.culprit else ""
    return Decision.STUCK, f"every rank parked and nothing moved between captures{culprit}"
