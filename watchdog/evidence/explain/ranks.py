"""What each process of a frozen engine is doing, and who the others wait for. Pure: stacks in, verdicts out.

Which frame decides, and what it says, is ``frame_rules``; this module picks the deciding thread of a process (the
main thread, or the thread it waits for), says why in a sentence, and reads the processes together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from watchdog.core.roles import Role, ranks_of, role_of_name, title_in
from watchdog.evidence.explain.classes import Cls, Status
from watchdog.evidence.explain.frame_rules import (
    COLL_FUNC,
    DRIVER_MODULES,
    SPEC,
    STARTUP,
    base_name,
    chain,
    decide,
    frame_role,
    is_helper,
    is_noise,
    main_thread,
    spec_key,
)
from watchdog.evidence.stacks.frames import Frame, ProcessStack, ThreadStack


@dataclass(frozen=True, slots=True)
class ProcessExplanation:
    name: str  # title without its "VLLM::"/"sglang::"/"ray::" prefix (Worker_TP1, EngineCore), else role[pid]
    pid: int | None
    role: Role | None  # None: neither the title nor a frame says
    rank: dict[str, int]
    cls: Cls
    thread: str  # the thread that decided
    frames: tuple[Frame, ...]  # the deciding frames, innermost first
    spec_decode: bool
    why: str
    spec_frames: tuple[Frame, ...] = ()
    crashed: str = ""  # faulthandler's "Current thread" when it is not the deciding one: what it was doing


@dataclass(frozen=True, slots=True)
class CrossRankVerdict:
    culprit: str | None
    reason: str
    frames: tuple[Frame, ...]
    diverged: bool = False  # the ranks wait in collectives that never match (typed: nobody parses the reason)


@dataclass(frozen=True, slots=True)
class HypothesisVerdict:
    status: Status
    reason: str
    frames: tuple[Frame, ...]
    spec_frames: tuple[Frame, ...] = ()



_BUSY = (Cls.IN_COLLECTIVE, Cls.MODEL_FORWARD, Cls.DEVICE_WAIT, Cls.COMPILE)
_IDLE = (Cls.IDLE_READER_WAIT, Cls.ENGINE_IDLE)
_SEVERITY = [Cls.UNKNOWN, *_IDLE, Cls.ENGINE_LOOP, Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING,
             Cls.MODEL_FORWARD, Cls.COMPILE, Cls.DEVICE_WAIT, Cls.IN_COLLECTIVE]  # the helper-thread class that wins
_KERNEL_ONLY = " Kernel stack only: no Python frame, so what the Python code was doing cannot be read."


def _label(t: ThreadStack | None) -> str:
    return "no thread" if t is None else t.name or (f"thread {t.thread_id}" if t.thread_id else "unnamed thread")


def _where(frames: tuple[Frame, ...]) -> str:
    shown = [f for f in frames if not is_noise(f)][:3] or list(frames[:1])
    return " < ".join(f"{f.function} ({f.file.rsplit('/', 1)[-1]})" for f in shown) or "no frames"


_WHY = {
    Cls.IDLE_READER_WAIT: "waits in the broadcast reader for the next step: idle, or the victim of a stuck peer",
    Cls.ENGINE_IDLE: "waits for new requests: nothing is scheduled",
    Cls.ENGINE_WAITING_WORKERS: "is inside a step waiting for the workers' replies",
    Cls.ENGINE_LOOP: "is in its own loop (scheduling, bookkeeping, an empty step), outside the model and not waiting",
    Cls.WRITER_BLOCKED_FULL_RING: "cannot write: every ring slot holds a block some reader has not consumed",
    Cls.IN_COLLECTIVE: "is inside a collective and waits for every peer of its group to join",
    Cls.DEVICE_WAIT: "is blocked until the device finishes its queued work",
    Cls.MODEL_FORWARD: "is running the model, with no collective or device wait on top",
    Cls.COMPILE: "is compiling, or waiting for a JIT build",
}


def _crashed(ps: ProcessStack, decided: ThreadStack | None, role: Role | None) -> str:
    """What faulthandler's "Current thread" (the thread that crashed or took the signal) was doing, when another
    thread decided the class."""
    cur = next((t for t in ps.threads if t.current), None)
    if cur is None or not cur.frames or cur is main_thread(ps):
        return ""
    if cur is decided:
        return f"The crashing thread ({_label(cur)}, faulthandler's current thread) is that thread."
    d = decide(cur.frames, role)
    cls = d[0] if d is not None else None
    frames = chain(cur.frames, d[1], d[2]) if d is not None and cls is not None else cur.frames[:3]
    doing = f"{_WHY[cls].removeprefix('is ')}" if cls in _WHY and cls is not None else "in no recognised frame"
    return f"The crashing thread ({_label(cur)}, faulthandler's current thread) was {doing}: {_where(frames)}."


def classify(ps: ProcessStack, role: Role | None = None, proc_state: str | None = None) -> ProcessExplanation:
    """Explain one process from its stacks; `role` overrides the guess, `proc_state` is /proc's state letter."""
    token = title_in(ps.title)
    main = main_thread(ps)
    ordered = ([main] if main else []) + [t for t in ps.threads if t is not main]
    named = role_of_name(token) if token else None
    role = (role or (named if named != Role.PROCESS else None)
            or next((r for t in ordered for f in t.frames if (r := frame_role(f))), None))
    name = token or (f"{role or 'process'}[{ps.pid}]" if ps.pid is not None else role or "process")
    working = [t for t in ordered if t is main or not is_helper(t)]
    spec = tuple(dict.fromkeys(f for t in working for f in t.frames if SPEC.search(spec_key(f))))

    def done(cls: Cls, t: ThreadStack | None, frames: tuple[Frame, ...], why: str) -> ProcessExplanation:
        why += f" Speculative-decoding frames present: {_where(spec)}." if spec else ""
        if ps.source == "kernel":
            driver = next((f.file for th in ps.threads for f in th.frames if DRIVER_MODULES.match(f.file)), None)
            why += _KERNEL_ONLY + (f" It is inside the {driver} driver." if driver else "")
        crashed = _crashed(ps, t, role)
        why += f" {crashed}" if crashed else ""
        rank = ranks_of(token)
        return ProcessExplanation(name, ps.pid, role, rank, cls, _label(t), frames, bool(spec), why, spec[:6], crashed)

    first = main or next((t for t in ordered if t.frames), None)
    top = chain(first.frames, 0, None) if first and first.frames else ()
    if proc_state and proc_state[:1] in ("T", "t"):
        return done(Cls.STOPPED, first, top, f"{name} is stopped (state {proc_state}): it runs no code; "
                                             f"last frames: {_where(top)}.")
    decided = [(t, d) for t in working if (d := decide(t.frames, role)) is not None]
    known = [(t, d) for t, d in decided if d[0] not in (None, Cls.UNKNOWN)]
    main_d = next((d for t, d in decided if t is main), None)
    main_note = main_d[3] if main_d else ("no frames" if main and not main.frames else "no recognised frame")
    best = next(((t, d) for t, d in known if t is main), None) or max(
        known, key=lambda td: _SEVERITY.index(td[1][0] or Cls.UNKNOWN), default=None
    )
    if best is None:
        what = f"main thread: {main_note}" if main else "no main thread in the dump and no other thread says more"
        return done(Cls.UNKNOWN, first, top, f"{name}: nothing recognised ({what}); top frames: {_where(top)}.")
    t, (cls, at, ctx, note) = best
    cls = cls or Cls.UNKNOWN
    frames = chain(t.frames, at, ctx, whole=cls in (Cls.MODEL_FORWARD, Cls.COMPILE))
    startup = " during startup" if any(base_name(f) in STARTUP for f in t.frames) else ""
    via = f"; main thread: {main_note}" if t is not main and main else ""
    return done(cls, t, frames, f"{name} ({_label(t)}{via}) {_WHY[cls]}{startup}{note}: {_where(frames)}.")




def _names(expls: list[ProcessExplanation]) -> str:
    return ", ".join(e.name for e in expls)


def _state(e: ProcessExplanation) -> str:
    return f"{e.name} {e.cls.value} ({_where(e.frames)})"


def _coll_of(e: ProcessExplanation) -> str:
    """The collective a rank waits in, by its innermost collective frame (all_reduce, barrier)."""
    return next((base_name(f) for f in e.frames if not f.native and COLL_FUNC.search(base_name(f))),
                base_name(e.frames[0]) if e.frames else "a collective")


def cross_rank(expls: list[ProcessExplanation], moved: dict[str, bool] | None = None,
               unread: dict[str, int | None] | None = None) -> CrossRankVerdict:
    """Name the process the others wait for. `moved[name]`: did its stacks change between captures (then it is
    slow, not frozen). `unread`: the broadcast ring's local readers by name, each with the block written for it and not
    read by it (None: it read every block); `unread` None: no ring was read, so a reader that never took its step
    cannot be told from one that finished it."""
    moved = moved or {}
    waiting = (Cls.ENGINE_WAITING_WORKERS, Cls.ENGINE_IDLE, Cls.WRITER_BLOCKED_FULL_RING)
    engine = next((e for e in expls if e.role == Role.ENGINE_CORE), None)
    workers = [e for e in expls if e.role in (Role.WORKER, Role.SCHEDULER, None)]
    workers_idle = bool(workers) and all(w.cls is Cls.IDLE_READER_WAIT for w in workers)

    def blame(pool: list[ProcessExplanation], say: Callable[[ProcessExplanation], str],
              diverged: bool = False) -> CrossRankVerdict:
        c = sorted(pool, key=lambda r: (bool(moved.get(r.name)), r.cls is Cls.UNKNOWN))[0]  # frozen ones first
        moving = "; its stacks moved between captures, so it is slow rather than frozen" if moved.get(c.name) else ""
        return CrossRankVerdict(c.name, f"{say(c)}{moving}.", c.frames, diverged)

    if stopped := [e for e in expls if e.cls is Cls.STOPPED]:
        rest = "; ".join(_state(e) for e in expls if e.cls is not Cls.STOPPED) or "no peers seen"
        return blame(stopped, lambda c: f"{c.name} is stopped and runs no code while the others wait: {rest}")
    if coll := [e for e in expls if e.cls is Cls.IN_COLLECTIVE]:
        peers = _names(coll)
        pool = workers + ([engine] if engine is not None and engine.cls not in waiting else [])
        others = [e for e in pool if e not in coll]
        if busy := [r for r in others if r.cls in _BUSY]:
            return blame(busy, lambda c: f"{_state(c)} while {peers} wait in a collective for it")
        idle = [r for r in others if r.cls in _IDLE]
        ring = unread or {}
        if parked := [r for r in idle if ring.get(r.name) is not None]:
            return blame(parked, lambda c: f"{c.name} parks in its reader with block {ring[c.name]} written for it "
                                           f"and never read: it never took the step (a lost wake-up) while {peers} "
                                           "took it and wait in a collective for it")
        if finished := [r for r in idle if r.name in ring]:
            return blame(finished, lambda c: f"the ranks diverged: {c.name} read every block written for it, finished "
                                         f"its step and is back in its reader while {peers} wait in a collective it "
                                         "never joins", True)
        if idle:
            return blame(idle, lambda c: f"{c.name} is back in its idle reader loop while {peers} wait in a "
                                         "collective: it left or skipped that collective (a failed or desynchronised "
                                         "step) and only looks idle, or never woke for its step (the ring was not "
                                         "read to tell)")
        if others:
            return blame(others, lambda c: f"{_state(c)} is not in the collective {peers} wait in")
        kinds = sorted({_coll_of(e) for e in coll if e.frames})
        each = ", ".join(f"{e.name} in {_coll_of(e)}" for e in coll)
        what = (f"different collectives ({each}): the ranks diverged" if len(kinds) > 1 else
                "the same collective: the transport (NCCL/gloo/network) or a rank missing from the dump is stuck")
        return CrossRankVerdict(None, f"every rank seen is inside {what}.", coll[0].frames, len(kinds) > 1)
    if engine is not None and engine.cls is Cls.ENGINE_WAITING_WORKERS:
        if slow := [w for w in workers if w.cls is not Cls.IDLE_READER_WAIT]:
            return blame(slow, lambda c: f"EngineCore waits for replies and {_state(c)} has not finished its step")
        if workers_idle:
            return CrossRankVerdict(None, "EngineCore waits for replies while every worker is parked in its reader: "
                                          "a lost wake-up, an unread block (see poll_parking) or a lost reply; no "
                                          "single rank to blame.", engine.frames)
    if engine is not None and workers_idle and engine.cls not in _IDLE:
        return blame([engine], lambda c: f"every worker waits for a broadcast EngineCore never sends; {_state(c)}")
    if all(e.cls in _IDLE for e in expls):
        return CrossRankVerdict(None, "every process is idle: nobody waits on anyone.", ())
    return CrossRankVerdict(None, f"no process is seen waiting on another ({'; '.join(map(_state, expls))}).", ())


def poll_parking(expls: list[ProcessExplanation], work_pending: bool | None,
                 stacks_changed: bool | None, unread: dict[str, int | None] | None = None,
                 ring: str = "") -> HypothesisVerdict:
    """Test poll-parking: work pending, EngineCore waiting on workers, every worker parked in its reader, no rank
    busy, nothing moving. With the broadcast ring read (``unread``: the blocks written for a local reader that it
    never read; ``ring``: what the ring showed, in words) a parked reader with an unread block is the lost wake-up
    itself, even while peers that took the step (remote readers) wait in a collective for it; a ring read to the last
    block contradicts it. Speculative-decoding frames (the rival hypothesis) are reported whatever the status."""
    spec = tuple(f for e in expls for f in e.spec_frames)
    rival = (f" Speculative-decoding frames seen in {_names([e for e in expls if e.spec_decode])} ({_where(spec)}): "
             "the rival hypothesis is a stall in the draft/verify path." if spec else "")

    def verdict(status: Status, reason: str, frames: tuple[Frame, ...] = ()) -> HypothesisVerdict:
        return HypothesisVerdict(status, reason + rival, frames, spec)

    engine = next((e for e in expls if e.role == Role.ENGINE_CORE), None)
    workers = [e for e in expls if e.role == Role.WORKER]
    ring_of = unread or {}
    parked = [w for w in workers if w.cls is Cls.IDLE_READER_WAIT and ring_of.get(w.name) is not None]
    busy = [e for e in expls if e.cls in (*_BUSY, Cls.STOPPED)]
    if parked and not stacks_changed and all(b.cls is Cls.IN_COLLECTIVE for b in busy) and (
            engine is None or engine.cls in (Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING)):
        # the ring says a step was handed out: work is pending whatever the page's gauges held
        took = f"; {_names(busy)} took the step and wait{'s' * (len(busy) == 1)} in a collective for " \
               f"{'it' if len(parked) == 1 else 'them'}" if busy else ""
        return verdict(Status.SUPPORTED, f"{_names(parked)} parked in the reader ({_where(parked[0].frames)}) with "
                                         f"block {ring_of[parked[0].name]} written for "
                                         f"{'it' if len(parked) == 1 else 'them'} and unread ({ring}){took}; "
                                         f"{'no EngineCore stack' if engine is None else _state(engine)}.",
                       (engine.frames if engine else ()) + parked[0].frames)
    if work_pending is False:
        return verdict(Status.NOT_APPLICABLE, "No work is pending: parked readers are simply idle.")
    if busy:
        return verdict(Status.CONTRADICTED, f"{_state(busy[0])}: a rank is busy, waiting on peers or stopped; the "
                                            "readers wait on it, not on a lost wake-up.", busy[0].frames)
    if stacks_changed:
        return verdict(Status.CONTRADICTED, "Stacks moved between captures: the engine is progressing.")
    if engine is not None and engine.cls is Cls.ENGINE_IDLE and work_pending:
        return verdict(Status.CONTRADICTED, "EngineCore waits for requests, not for workers: the pending work is "
                                            "held elsewhere (a connector, the scheduler).", engine.frames)
    missing = [] if engine else ["no EngineCore stack"]
    if engine is not None and engine.cls not in (Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING):
        missing.append(f"EngineCore is {engine.cls.value}, not waiting on a reply or blocked writing")
    if others := [w for w in workers if w.cls is not Cls.IDLE_READER_WAIT]:
        missing.append("not in reader wait: " + ", ".join(f"{w.name} ({w.cls.value})" for w in others))
    missing += [] if workers else ["no worker stacks"]
    missing += [] if work_pending is not None else ["work state unknown"]
    missing += [] if stacks_changed is not None else ["single capture: parked cannot be told from passing through"]
    if missing or engine is None:
        return verdict(Status.INCONCLUSIVE, "Cannot decide: " + "; ".join(missing) + ".")
    if ring_of and not parked and all(w.name in ring_of for w in workers):
        return verdict(Status.CONTRADICTED, f"Every worker is parked, but the ring shows every block written for them "
                                            f"read ({ring}): they took their step and came back; what is lost is a "
                                            f"reply to EngineCore, not a wake-up.", engine.frames)
    return verdict(Status.SUPPORTED, f"Work pending; {_state(engine)}; all {len(workers)} workers parked in the reader "
                                     f"({_where(workers[0].frames)}); no rank busy; stacks unchanged between captures.",
                   engine.frames + workers[0].frames)
