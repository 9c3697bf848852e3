"""From a capture to findings: each process explained, whether it moved, who is to blame, and what the
judgement should do with the suspicion (confirm it, clear it, or leave it to the metric window).

Pure: it reads a Capture (two rounds of py-spy JSON with /proc facts) and returns data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from watchdog.core.processes import Capture, Dump, EngineProcess
from watchdog.core.ring import Ring
from watchdog.core.roles import ENGINE_ROLES, Role, title_in
from watchdog.core.types import Decision
from watchdog.evidence.explain.classes import Cls, Status
from watchdog.evidence.explain.engine_scope import engine_processes
from watchdog.evidence.explain.ranks import (
    CrossRankVerdict,
    HypothesisVerdict,
    ProcessExplanation,
    classify,
    cross_rank,
    poll_parking,
)
from watchdog.evidence.explain.ring_layout import family
from watchdog.evidence.explain.ring_said import ring_readers, said_all
from watchdog.evidence.stacks.parse import Frame, ProcessStack, StackParseError, parse_pyspy_json

_WORKING = {Cls.MODEL_FORWARD, Cls.COMPILE}  # a rank doing real work: the silence is a long step
# Waiting loops move between their own lines (spin, poll with a timeout, re-check): that is not progress.
_WAITING = {Cls.IDLE_READER_WAIT, Cls.ENGINE_IDLE, Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING,
            Cls.STOPPED}
# Where EngineCore may pass while it schedules nothing: moving only through these is its loop turning, not work.
_LOOP = {Cls.ENGINE_LOOP, Cls.ENGINE_WAITING_WORKERS, Cls.ENGINE_IDLE, Cls.IDLE_READER_WAIT}
# Where a rank may pass in the empty steps of an admission stall (running=0): an execute_model that returns at once,
# and the ring writer handing the step out (EngineCore) or its empty result back (the output rank: vLLM 0.32's
# WorkerProc.enqueue_output > MessageQueue.enqueue / acquire_write). None of it is work while nothing runs.
_EMPTY_STEP = _WORKING | {Cls.UNKNOWN, Cls.WRITER_BLOCKED_FULL_RING}
# CPU seconds per second of gap above which a looping EngineCore is burning CPU, not sleeping. Measured on the real
# CPU vLLM 0.32 (tests/data/livelock): a livelock's EngineCore 0.29 (its two workers spinning beside it on 2 shared
# cores), an admission stall's 0.23; a parked EngineCore (stopped, or in poll) about 0.
_BURN = 0.1
# The shortest pause between rounds whose CPU is trusted as the rate (a clock tick is 10 ms); shorter: the whole span.
_QUIET_MIN = 0.5


@dataclass(frozen=True, slots=True)
class PageWork:
    """What the engine's page said when the suspicion arose: requests running and waiting (None: not read)."""

    running: float | None = None
    waiting: float | None = None

    @property
    def idle(self) -> bool:  # read, and no request running or waiting
        return self.running == 0 and self.waiting == 0

    @property
    def admission_stall(self) -> bool:
        """Requests wait while none runs: nothing is being computed for anyone."""
        return self.running == 0 and (self.waiting or 0) > 0

    def __str__(self) -> str:
        return f"running={self.running:g}, waiting={self.waiting:g}" if self.running is not None and \
            self.waiting is not None else "running/waiting unknown"


class StuckKind(StrEnum):
    """Why the stacks confirm a freeze (Decision.STUCK): typed, so nobody parses the reason."""

    PARKED = "parked"  # every rank parked and nothing moved
    LIVELOCK = "livelock"  # EngineCore turns its loop, burning CPU, and never reaches the model
    ADMISSION_STALL = "admission_stall"  # requests wait, none runs, and nothing moves toward running them
    LOST_WAKEUP = "lost_wakeup"  # a reader parked in its poll with a block written for it and unread (the ring)
    DIVERGED = "diverged"  # ranks in collectives that do not match: one entered a collective its peers never join


@dataclass(frozen=True, slots=True)
class ProcessFinding:
    process: EngineProcess
    explanation: ProcessExplanation | None  # None when no dump could be read
    moved: bool | None  # deciding frames differ between the two captures (None: not two good captures)
    cpu_seconds: float | None  # CPU used between the captures
    state: str  # /proc state at the first capture
    error: str  # why there is no explanation
    last_cls: Cls | None = None  # the class at the last capture (None: not two good captures)
    gap: float | None = None  # seconds between its first and last dump
    native: ProcessExplanation | None = None  # its --native dump explained (a process holding a GPU), if taken
    quiet: tuple[float, float] | None = None  # (CPU s, s) in the pauses between rounds, no py-spy attached

    @property
    def burn(self) -> tuple[float, float] | None:
        """(CPU s, s) to judge its CPU rate by: the quiet pauses when long enough (a blocking dump suspends the
        process, and slow dumps stretch the rounds apart), else the whole span between its first and last dump."""
        if self.quiet is not None and self.quiet[1] >= _QUIET_MIN:
            return self.quiet
        if self.cpu_seconds is not None and self.gap:
            return self.cpu_seconds, self.gap
        return None


@dataclass(frozen=True, slots=True)
class Findings:
    processes: tuple[ProcessFinding, ...]
    cross_rank: CrossRankVerdict
    hypothesis: HypothesisVerdict
    decision: Decision
    reason: str
    complete: bool
    problems: tuple[str, ...]
    stuck_kind: StuckKind | None = None  # set when decision is STUCK
    page: PageWork | None = None  # the page's running/waiting the decision was made with


def _stack(dump: Dump, proc: EngineProcess) -> ProcessStack | None:
    if not dump.ok:
        return None
    try:  # another node's dump is its agent's word: nested past the parser's recursion, it is unreadable, no crash
        return parse_pyspy_json(json.loads(dump.output), pid=proc.pid,
                                title=proc.title if proc.node == "local" else proc.label)
    except (ValueError, RecursionError, StackParseError):
        return None


def _quiet(later: list[Dump]) -> tuple[float, float] | None:
    """The quiet pauses before the later rounds, summed; None unless every one of them was measured."""
    spans = [d.quiet for d in later]
    if not spans or any(q is None for q in spans):
        return None
    return round(sum(q[0] for q in spans if q), 3), round(sum(q[1] for q in spans if q), 3)


def _frames_key(frames: tuple[Frame, ...]) -> tuple[tuple[str, str, int | None], ...]:
    return tuple((f.function, f.file, f.line) for f in frames)


def _thread_frames(ps: ProcessStack, label: str) -> tuple[Frame, ...]:
    """The frames of the thread an explanation names (by name, or "thread <id>" for unnamed ones)."""
    for t in ps.threads:
        if label in (t.name, f"thread {t.thread_id}"):
            return t.frames
    return ()


def assess(capture: Capture, work_pending: bool | None, page: PageWork | None = None, engine: str = "") -> Findings:
    """Assess a capture; ``page``: the page's running/waiting at suspicion (livelock and admission-stall rules);
    ``engine``: the page's engine suspected, whose own processes alone decide (a data-parallel server's others are
    reported, not counted: `engine_scope`)."""
    found: list[ProcessFinding] = []
    for proc in capture.processes:
        dumps = capture.dumps_of(proc)
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
        last_cls: Cls | None = None
        gap: float | None = None
        quiet = _quiet(dumps[1:])
        if len(stacks) >= 2 and (last_stack := stacks[-1]) is not None:
            last_cls = classify(last_stack, proc.role, dumps[-1].facts.state if dumps[-1].facts else None).cls
            moved = _frames_key(_thread_frames(stacks[0], expl.thread)) != _frames_key(
                _thread_frames(last_stack, expl.thread))
            if moved and expl.cls in _WAITING:
                moved = last_cls != expl.cls  # a wait loop passes through its own lines; only leaving it is progress
            last = dumps[-1].facts
            if first and first.facts and last:
                cpu = round(last.cpu_seconds - first.facts.cpu_seconds, 3)
            gap = round(dumps[-1].t - dumps[0].t, 3)
        error = ""
        if len(capture.rounds) >= 2 and moved is None:  # unknown whether it moved: the capture is incomplete
            error = (dumps[-1].error if len(dumps) >= 2 else "") or "no readable dump in the last round"
        native = capture.native.get(proc.id)
        native_stack = _stack(native, proc) if native is not None else None
        found.append(ProcessFinding(proc, expl, moved, cpu, state, error, last_cls, gap,
                                    classify(native_stack, proc.role, state) if native_stack else None, quiet))
    scope = engine_processes(capture.processes, engine)
    counted = [f for f in found if scope is None or f.process.role not in ENGINE_ROLES or f.process.id in scope]
    expls = [f.explanation for f in counted if f.explanation is not None]
    moved_by_name = {f.explanation.name: bool(f.moved) for f in counted if f.explanation is not None}
    engine_procs = [f for f in counted if f.process.role in ENGINE_ROLES]
    two_rounds = len(capture.rounds) >= 2
    any_moved = any(f.moved for f in engine_procs) if two_rounds else None
    labels = {title_in(f.process.title) or f.process.label for f in engine_procs}  # its rings, named as written
    rings = tuple(r for r in capture.rings if r.ok and (scope is None or r.writer in labels))
    unread = ring_readers(rings)
    cross = cross_rank(expls, moved_by_name if two_rounds else None, unread)
    hypothesis = poll_parking([e for e in expls if e.role in (Role.ENGINE_CORE, Role.WORKER)], work_pending, any_moved,
                              unread, said_all(rings) if rings else "")
    complete = bool(engine_procs) and all(not f.error for f in engine_procs) and not capture.unseen_nodes
    decision, reason, kind = _decide(engine_procs, complete, two_rounds, cross, page or PageWork(),
                                     capture.unseen_nodes, work_pending)
    if decision is Decision.STUCK and kind is StuckKind.PARKED:
        decision, reason, kind = _parked_why(reason, cross, hypothesis, rings, engine_procs)
    return Findings(tuple(found), cross, hypothesis, decision, reason, complete,
                    tuple(str(p) for p in capture.problems), kind, page)


# From this release on an idle reader re-checks the ring every 5 s (vLLM PR #45224): a parked reader with a block
# written for it takes the block by itself within 5 s; it is late, not lost.
_RECHECK_FROM = (0, 27)


def _parked_why(reason: str, cross: CrossRankVerdict, hyp: HypothesisVerdict, rings: tuple[Ring, ...],
                procs: list[ProcessFinding]) -> _Said:
    """The finer cause of parked ranks: a lost wake-up (the ring shows a block a parked reader never took) or ranks
    diverged (collectives that do not match); an engine that re-checks its ring is not stuck on an unread block, and
    readers in vLLM's bounded spin that all burned CPU between the captures, with the ring showing every block taken,
    were not parked (both captures caught their poll, not their steps: seen on vLLM 0.32 with every step's wake-up
    lost, the readers re-checking every 5 s); one that burned nothing among them is the one parked."""
    readers = [f for f in procs if f.explanation is not None and f.explanation.cls is Cls.IDLE_READER_WAIT]
    took_all = bool(rings) and not any(r.unread() for r in rings)  # the ring: every block handed out was taken
    if (took_all and readers and _bounded_spin(procs) and all(_burns(f) for f in readers)
            and (spun := [f for f in readers if f.burn is not None])):
        said = ", ".join(f"{f.explanation.name} {f.burn[0]:g} CPU s in {f.burn[1]:g} s" for f in spun
                         if f.explanation is not None and f.burn is not None)
        return Decision.UNDECIDED, (f"the readers seen parked burned CPU between the captures ({said}): they took "
                                    "steps between them, so parked is not shown; the metric window decides"), None
    if hyp.status is Status.SUPPORTED and rings:
        fams = [f for r in rings if (f := family(r.version)) is not None]
        if fams and min(fams) >= _RECHECK_FROM:
            return Decision.WORKING, (f"a reader is late to a block written for it ({said_all(rings)}): vLLM "
                                      f"{rings[0].version} re-checks its ring every 5 s, so it takes the block by "
                                      "itself (a late wake-up, not the lost one)"), None
        return Decision.STUCK, f"lost wake-up: {hyp.reason}", StuckKind.LOST_WAKEUP
    if cross.diverged:
        return Decision.STUCK, f"ranks diverged: {cross.reason}", StuckKind.DIVERGED
    return Decision.STUCK, reason, StuckKind.PARKED


def _unread(procs: list[ProcessFinding]) -> str:
    """Which processes could not be read and why, each cause (with its fix) once: "ptrace was denied...: TP0, TP1"."""
    by_error: dict[str, list[str]] = {}
    for f in procs:
        if f.error:
            by_error.setdefault(f.error, []).append(f.process.label)
    return "; ".join(f"{', '.join(labels)}: {error}" for error, labels in by_error.items())


_Said = tuple[Decision, str, StuckKind | None]


def _classes(f: ProcessFinding) -> set[Cls]:
    return {c for c in (f.explanation.cls if f.explanation else None, f.last_cls) if c is not None}


def _in_work(f: ProcessFinding, stall: bool) -> bool:
    """In the model or compiling. With nothing running (``stall``) the scheduler gave the model nothing to do: only a
    rank in it at both captures is a step; one seen there once passed through an empty step."""
    first = f.explanation is not None and f.explanation.cls in _WORKING
    if stall and f.last_cls is not None:
        return first and f.last_cls in _WORKING
    return first or f.last_cls in _WORKING


def _burns(f: ProcessFinding) -> bool:
    return (b := f.burn) is not None and b[0] >= _BURN * b[1]


def _ring_turns(procs: list[ProcessFinding]) -> bool:
    """Every worker spins in its reader, burning CPU, not stopped: the readers' busy spin (vLLM's SpinCondition) lasts
    about a second after each step, so they burn only while steps keep coming; a reader that stopped reading, or a
    worker stopped or parked in its poll, burns nothing. With EngineCore burning too, the whole engine turns empty
    steps: a writer blocked on the full ring outruns its readers, a wait on the replies is the next empty step's."""
    workers = [f for f in procs if f.process.role == Role.WORKER]
    return bool(workers) and all(_burns(w) and _classes(w) and _classes(w) <= _LOOP and w.state not in ("T", "t", "Z")
                                 for w in workers)


def _bounded_spin(procs: list[ProcessFinding]) -> bool:
    """Every worker's reader spins in vLLM's SpinCondition (about a second after each step, then a poll): its burn
    means steps keep coming. Older readers spin for ever (sched_yield in acquire_read), so there it means nothing."""
    workers = [f for f in procs if f.process.role == Role.WORKER]
    return bool(workers) and all(f.explanation is not None and any(
        fr.function.endswith("SpinCondition.wait") for fr in f.explanation.frames) for f in workers)


def _burning(procs: list[ProcessFinding], stall: bool, loop: set[Cls], steps: bool) -> ProcessFinding | None:
    """An EngineCore turning its loop (never leaving it at either capture) on at least ``_BURN`` of a core; with
    ``steps`` (every worker burning in a bounded reader spin) also one seen only waiting on the replies."""
    for f in procs:
        if f.process.role != Role.ENGINE_CORE or not _burns(f) or not _classes(f) <= loop:
            continue
        if Cls.ENGINE_LOOP in _classes(f) or f.moved or stall or (steps and Cls.ENGINE_IDLE not in _classes(f)):
            return f
    return None


def _decide(procs: list[ProcessFinding], complete: bool, two_rounds: bool,
            cross: CrossRankVerdict, page: PageWork, unseen: tuple[str, ...] = (),
            pending: bool | None = None) -> _Said:
    """Stacks clear a suspicion only with a rank in the model (a kernel, the sampler) or compiling, or movement
    outside EngineCore's own loop; they confirm it when every engine process was read, twice, and nothing but that
    loop moved: a livelock (the loop burning CPU), an admission stall (requests wait, none runs) or parked ranks."""
    stall = page.admission_stall
    if working := [f for f in procs if _in_work(f, stall)]:
        e = working[0].explanation
        assert e is not None
        cls = e.cls if e.cls in _WORKING else working[0].last_cls
        assert cls is not None
        return Decision.WORKING, f"{e.name} is {cls.value}: a long step, not a freeze", None
    ring = _ring_turns(procs)
    engine_loop = _LOOP | ({Cls.WRITER_BLOCKED_FULL_RING} if ring else set())
    loop = engine_loop | (_EMPTY_STEP if stall else set())
    movers = [f for f in procs if f.moved and f.explanation is not None]
    if real := [f for f in movers if not _classes(f) <= loop]:
        names = ", ".join(f.explanation.name for f in real if f.explanation)
        return Decision.WORKING, f"stacks moved between captures ({names})", None
    if not procs:
        return Decision.UNDECIDED, "no engine process found to take stacks of", None
    if not complete:
        missing = [f"no stacks from node {n}" for n in unseen]
        return Decision.UNDECIDED, f"incomplete capture ({'; '.join(filter(None, [_unread(procs), *missing]))})", None
    if not two_rounds:
        return Decision.UNDECIDED, "a single capture cannot tell parked from passing through", None
    names = ", ".join(f.explanation.name for f in movers if f.explanation)
    turned = f" (moved only in its loop: {names})" if movers else ""
    burn = _burning(procs, stall, engine_loop, ring and _bounded_spin(procs))
    rate = burn.burn if burn else None
    turning = (f"{burn.explanation.name} turns its own loop ({', '.join(sorted(c.value for c in _classes(burn)))}) "
               f"on {rate[0]:g} CPU s in {rate[1]:g} s" if burn and burn.explanation and rate else "")
    if stall:  # the page says why the loop turns empty (vLLM 0.32 steps empty batches, burning CPU): the finer word
        return Decision.STUCK, (f"admission stall: {page} and nothing moves toward running them; no rank is in "
                                f"the model{'; ' + turning if turning else ''}{turned}"), StuckKind.ADMISSION_STALL
    if turning:
        return Decision.STUCK, (f"livelock: {turning} and no rank is in the model ({page}){turned}"), StuckKind.LIVELOCK
    if movers:
        return Decision.UNDECIDED, (f"stacks moved only in EngineCore's loop ({names}) without burning CPU "
                                    f"({page}): not a long step; the metric window decides"), None
    if page.idle and not pending and (cores := [f for f in procs if f.process.role == Role.ENGINE_CORE]) and all(
            f.explanation is not None and f.explanation.cls is Cls.ENGINE_IDLE for f in cores):  # a probe's request
        return Decision.IDLE, f"EngineCore waits for requests and the page shows none ({page})", None  # is work
    culprit = f"; culprit: {cross.culprit}" if cross.culprit else ""
    on_device = [f.explanation.name for f in procs if f.explanation and f.explanation.cls == Cls.DEVICE_WAIT]
    if on_device:  # not parked in a poll: waiting for its own GPU to finish (a kernel that spins or never ends)
        who = f"{on_device[0]} waits" if len(on_device) == 1 else f"{', '.join(on_device)} wait"
        return Decision.STUCK, (f"{who} on its own GPU (device_wait) and nothing moved between captures"
                                f"{culprit}"), StuckKind.PARKED
    return Decision.STUCK, f"every rank parked and nothing moved between captures{culprit}", StuckKind.PARKED
