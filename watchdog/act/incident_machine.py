"""The incident machine: every incident's life in one pure function, ``step(book, event, settings, wall)``.

Events in (`watchdog.act.incident_types`): a pass's verdicts (`Tick`, with the recovery that ended), what the
stacks said (`StacksSaid`), a pass of sight (`Sighted`), the watchdog's start (`Resumed`). Commands out, in order:
save the memory, write an event, alert, take a bundle, restart, wait for the engine to serve, log.

An engine's incident (one at a time: the restart acts on the whole stack) opens when an engine is frozen, down for
``down_after`` s or starting for longer than the boot timeout, with its id; a freeze or a down engine asks for its
bundle then, and waits for it at most ``evidence_timeout`` s. Each later pass confirms it is still bad and asks the
policy (`watchdog.act.policy.choose`): restart, wait, hold, give up or only watch. While a recovery runs nothing
is decided; it ends ``recovered`` then ``resolved``, or ``restart_failed`` and back to deciding. An incident that
clears by itself is ``resolved``. Blind incidents (`watchdog.act.incident_sight`) sit beside it and never restart.

Time arrives as data: ``wall`` (the wall clock, for ids, payloads and the budget, which outlive the process) and
each event's ``mono`` (the judge's clock, for verdicts and every wait: the bundle's, a hold's, the boot timeout's; a
step of the wall clock moves none of them). Ids take the event's nonce: the same inputs give the same outputs.
"""

from __future__ import annotations

from dataclasses import replace

from watchdog.act import incident_sight
from watchdog.act.incident_draft import Draft
from watchdog.act.incident_types import (
    ACTIVE,
    Book,
    Capture,
    Command,
    Event,
    GaveUp,
    Incident,
    Kind,
    Phase,
    Prove,
    RecoveryEnded,
    RecoveryJob,
    Restart,
    Resumed,
    Say,
    Settings,
    Sighted,
    StacksSaid,
    StepsDone,
    Tick,
)
from watchdog.act.policy import Budget, Choice, Ruling, choose, in_hand
from watchdog.core.runbooks import Runbook
from watchdog.core.types import Decision, State, Verdict
from watchdog.evidence.explain.log_cause import down_runbook

CLEARED = "the engine serves again without a restart"


def step(book: Book, event: Event, settings: Settings, wall: float) -> tuple[Book, list[Command]]:
    """The book after ``event``, and what to do about it."""
    d = Draft(book, settings, wall, getattr(event, "nonce", "0000"))
    if isinstance(event, Tick):
        _tick(d, event)
    elif isinstance(event, StacksSaid):
        _stacks(d, event)
    elif isinstance(event, Sighted):
        incident_sight.sighted(d, event)
    elif isinstance(event, Resumed):
        _resumed(d)
    return d.book, d.out


def budget(s: Settings) -> Budget:
    return Budget(s.budget, s.budget_window, s.backoff_initial, s.backoff_max)


# -- the events ------------------------------------------------------------------------------------------------------


def _resumed(d: Draft) -> None:
    for b in d.memory.blind:
        d.out.append(Say(f"blind incident {b.id} ({incident_sight.name(b)} cannot be seen) still open from before; "
                         "resolved once seen"))
    inc = d.memory.incident
    if inc is None:
        return
    d.out.append(Say(f"resuming incident {inc.id} ({inc.kind.value}, phase {inc.phase.value})"))
    d.emit(inc, "incident_resumed", phase=inc.phase.value)
    if inc.phase in ACTIVE:  # caught mid-recovery: it goes on waiting, never restarts
        started = inc.restart_started or inc.detected  # walls of an earlier life: read once, and bounded
        inc = d.keep(replace(inc, phase=Phase.PROVING))
        d.save()
        d.out.append(Prove(RecoveryJob(inc.id, False, min(d.s.boot_timeout, max(0.0, started + d.s.boot_timeout
                                                                                   - d.wall)))))


def _tick(d: Draft, ev: Tick) -> None:
    d.update(verdicts={v.engine: v for v in ev.verdicts}, mono=ev.mono, paused=ev.paused, reset_at=ev.reset_at)
    _walls_ahead(d)
    if ev.ended is not None:
        _recovery_ended(d, ev.ended)
    inc = d.memory.incident
    if inc is None:
        if (opened := _trouble(d, ev.verdicts)) is not None:
            _open(d, *opened)
        return
    if inc.phase in ACTIVE:
        if inc.phase == Phase.RESTARTING and ev.recovering == Phase.PROVING:
            inc = d.keep(replace(inc, phase=Phase.PROVING))  # the steps are done: waiting for a generation
            d.save()
            _steps_event(d, inc, ev.steps)
        return  # nothing else is decided for the stack until the recovery reports
    if _cleared(d, inc):
        _resolve(d, inc, CLEARED)
    elif (inc.phase != Phase.EVIDENCE or d.book.mono >= d.book.evidence_until) and _confirmed(d, inc):
        _decide(d, inc)


def _walls_ahead(d: Draft) -> None:
    """Walls remembered ahead of the clock (it stepped back since: NTP on a host whose clock ran ahead) are moved to
    now, once: a restart an hour "in the future" would hold the next one an hour in backoff, and a give-up there
    would outlive `watchdog reset`, and a down engine would stay unrestarted."""
    m, now = d.memory, d.wall
    ahead = [t for t in m.restarts if t > now] + ([m.gave_up.at] if m.gave_up and m.gave_up.at > now else [])
    if not ahead:
        return
    d.remember(restarts=tuple(min(t, now) for t in m.restarts),
               gave_up=m.gave_up and replace(m.gave_up, at=min(m.gave_up.at, now)))
    d.save()
    d.out.append(Say(f"the wall clock is {max(ahead) - now:.0f}s behind what was remembered (it stepped back): "
                     "the restarts and the give-up recorded ahead of it count from now"))


def _stacks(d: Draft, ev: StacksSaid) -> None:
    """A check's stacks (kept: a freeze they confirm is alerted with their headline), or an incident's bundle. A
    down incident takes only its own bundle: no stacks hold it."""
    inc = d.memory.incident
    said = (str(ev.details.get("headline") or ""), str(ev.details.get("runbook") or ""))
    ours = inc is not None and inc.engine == ev.engine and (
        inc.kind == Kind.FROZEN or (inc.kind == Kind.DOWN and ev.final and ev.incident == inc.id))
    if inc is None or not ours:
        d.update(stacks_said={**d.book.stacks_said, ev.engine: said if ev.decision == Decision.STUCK else ("", "")})
        return
    inc = d.keep(replace(inc, evidence=(ev.decision or inc.evidence) if inc.kind == Kind.FROZEN else None,
                         bundle=ev.bundle or inc.bundle,
                         phase=Phase.OPEN if ev.final and inc.phase == Phase.EVIDENCE else inc.phase))
    d.save()
    if ev.final:
        verdict = ev.decision.value if ev.decision else None
        d.notify(inc, "evidence_captured", said[0] or f"stacks: {verdict or 'not taken'}",
                 {"kind": inc.kind.value, "verdict": verdict, "bundle": ev.bundle, **ev.details},
                 runbook=Runbook(said[1] or Runbook.FROZEN))


# -- opening, deciding, closing -------------------------------------------------------------------------------------


def _trouble(d: Draft, verdicts: tuple[Verdict, ...]) -> tuple[Kind, Verdict] | None:
    """A new incident, from verdicts begun after the last incident ended (the pass that proves an engine back may
    still carry the verdict of the restart it ends)."""
    quiet, mono = d.book.quiet_since, d.book.mono

    def lasted(v: Verdict) -> float:
        return mono - (v.since if quiet is None else max(v.since, quiet))

    for v in verdicts:
        if v.state == State.FROZEN and (quiet is None or v.since > quiet or lasted(v) >= d.s.stall_window):
            return Kind.FROZEN, v
    for v in verdicts:
        if v.state == State.DOWN and lasted(v) >= d.s.down_after:
            return Kind.DOWN, v
        if v.state == State.STARTING and lasted(v) >= d.s.boot_timeout:
            return Kind.BOOT_TIMEOUT, v
    return None


def _open(d: Draft, kind: Kind, v: Verdict) -> None:
    bundled = (kind == Kind.FROZEN and d.s.capture) or (kind == Kind.DOWN and d.s.down_bundles)
    inc = Incident(d.new_id(d.wall, v.engine, kind), v.engine, kind, d.wall, v.reason,
                   Phase.EVIDENCE if bundled else Phase.OPEN)
    d.keep(inc, said="", evidence_until=d.book.mono + d.s.evidence_timeout, opened_mono=(inc.id, d.book.mono))
    d.save()
    d.emit(inc, "incident_opened", reason=v.reason)
    inc = d.keep(replace(inc, in_hand=in_hand(_ruling(d, inc, paused=False).choice)))  # in the budget: no page
    if bundled:  # a freeze's stacks, a down engine's log cause: taken before any restart writes over them
        d.out.append(Capture(inc))
    stacks = dict(d.book.stacks_said)
    said, rb = stacks.pop(v.engine, ("", ""))  # a freeze the stacks confirmed: their headline
    d.update(stacks_said=stacks)
    if not (said and said in v.reason):
        said, rb = v.reason, ""
    rb = rb or {Kind.FROZEN: Runbook.FROZEN, Kind.BOOT_TIMEOUT: Runbook.STARTING_TOO_LONG}.get(
        kind, down_runbook(v.reason)).value  # else by kind (down: a rank lost, or the API server)
    details: dict[str, object] = {"kind": kind.value}
    if kind != Kind.DOWN:
        details["stalled_for"] = round(v.stalled_for, 1)
    d.notify(inc, "engine_down" if kind == Kind.DOWN else "stall_detected", said, details, runbook=Runbook(rb))
    if inc.phase == Phase.OPEN:
        _decide(d, inc)


def _cleared(d: Draft, inc: Incident) -> bool:
    """Serving again by itself: idle after a proven generation, or working with progress seen since the incident
    opened. Stacks alone do not count, nor work a watcher has seen nothing of yet (a watchdog restarted over the
    incident: its first page shows requests running, and nothing moving)."""
    v = d.book.verdicts.get(inc.engine)
    if v is None or v.stacks_only:
        return False
    opened = _since(d.book.opened_mono, inc.id, d.book.mono - (d.wall - inc.detected))
    return v.state == State.IDLE or (v.state == State.WORKING and v.last_progress is not None
                                     and v.last_progress >= opened)


def _since(mark: tuple[str, float] | None, incident: str, otherwise: float) -> float:
    """The monotonic time ``mark`` holds for ``incident``, or (an incident of an earlier life) ``otherwise``."""
    return mark[1] if mark is not None and mark[0] == incident else otherwise


def _confirmed(d: Draft, inc: Incident) -> bool:
    """Still bad in this pass's verdicts: the last check before acting."""
    v = d.book.verdicts.get(inc.engine)
    if v is None:
        return inc.kind == Kind.DOWN  # the engine's series are gone with the server
    if inc.attempts:  # a restart did not bring it back by the boot timeout: still starting is still bad
        return v.state in (State.FROZEN, State.DOWN, State.STARTING)
    wanted = {Kind.FROZEN: (State.FROZEN, State.DOWN), Kind.DOWN: (State.DOWN,),
              Kind.BOOT_TIMEOUT: (State.STARTING,)}
    return v.state in wanted.get(inc.kind, ())


def _ruling(d: Draft, inc: Incident, working: bool = False, paused: bool | None = None) -> Ruling:
    s, m = d.s, d.memory
    gave_up = m.gave_up is not None and m.gave_up.at >= d.book.reset_at
    return choose(inc.kind, budget=budget(s), restarts=m.restarts, now=d.wall, reset_at=d.book.reset_at,
                  stacks_working=working, paused=d.book.paused if paused is None else paused, dry_run=s.dry_run,
                  gave_up=gave_up, has_steps=s.has_steps, supervised=s.supervised, on_boot_timeout=s.on_boot_timeout)


def _decide(d: Draft, inc: Incident) -> None:
    working = inc.evidence == Decision.WORKING
    held = None if inc.held_since is None else \
        d.book.mono - _since(d.book.held_mono, inc.id, d.book.mono - (d.wall - inc.held_since))
    if working and held is not None and held >= d.s.hold_max:
        working = False
        if d.book.said != "held too long":
            d.update(said="held too long")
            d.emit(inc, "hold_ended", reason=f"held {held:.0f}s without progress")
    r = _ruling(d, inc, working)
    if r.choice != Choice.PAUSED:  # once out of hand (a human is needed) it pages; a pause only waits
        inc = replace(inc, in_hand=inc.in_hand and in_hand(r.choice))
    if r.choice == Choice.HOLD and inc.held_since is None:
        inc = replace(inc, held_since=d.wall)
        d.update(held_mono=(inc.id, d.book.mono))
    d.keep(inc)
    if r.choice == Choice.RESTART:
        _restart(d, inc)
    elif r.choice == Choice.AWAIT_SUPERVISOR:
        inc = replace(inc, phase=Phase.PROVING)
        d.keep(inc)
        d.save()
        d.emit(inc, "awaiting_supervisor", reason=r.reason)
        d.out.append(Prove(RecoveryJob(inc.id, False, d.s.boot_timeout)))
    elif r.choice == Choice.GIVE_UP:
        if inc.phase != Phase.GAVE_UP:
            _give_up(d, inc, r)
    else:
        _announce(d, inc, r)


def _give_up(d: Draft, inc: Incident, r: Ruling) -> None:
    inc = replace(inc, phase=Phase.GAVE_UP)
    d.keep(inc)
    d.remember(gave_up=GaveUp(d.wall, inc.id, r.reason))
    d.save()
    d.emit(inc, "gave_up", reason=r.reason)
    d.notify(inc, "gave_up", f"gave up, a human is needed: {r.reason}",
             {"kind": inc.kind.value, "restarts_in_window": len(budget(d.s).recent(d.memory.restarts, d.wall))},
             runbook=Runbook.GAVE_UP)


def _announce(d: Draft, inc: Incident, r: Ruling) -> None:
    """Hold, wait, observe, paused, dry run: said once each, not every pass."""
    said = f"{r.choice.value}: {r.reason.split(':')[0]}"
    if said == d.book.said:
        return
    inc = replace(inc, phase={Choice.HOLD: Phase.HELD, Choice.WAIT: Phase.WAITING}.get(r.choice, Phase.OBSERVING))
    d.keep(inc, said=said)
    d.save()
    extra = {"plan": list(d.s.plan)} if r.choice == Choice.DRY_RUN else {}
    d.emit(inc, f"restart_{'held' if r.choice == Choice.HOLD else 'not_run'}", choice=r.choice.value,
           reason=r.reason, **extra)
    d.out.append(Say(f"incident {inc.id}: {r.reason}"))


def _restart(d: Draft, inc: Incident) -> None:
    inc = replace(inc, phase=Phase.RESTARTING, attempts=inc.attempts + 1, restart_started=d.wall)
    d.keep(inc)
    b = budget(d.s)
    d.remember(restarts=(*b.recent(d.memory.restarts, d.wall), d.wall))
    d.save()  # on disk before acting: a crash from here on resumes, never restarts twice
    left = b.left(d.memory.restarts, d.wall, d.book.reset_at)
    d.emit(inc, "restart_started", attempt=inc.attempts, budget_left=left, plan=list(d.s.plan))
    d.notify(inc, "restart_started", f"restart {inc.attempts} issued ({left} left in the budget)",
             {"kind": inc.kind.value, "attempt": inc.attempts, "budget_left": left})
    d.out.append(Restart(RecoveryJob(inc.id, True, d.s.boot_timeout)))


def _recovery_ended(d: Draft, done: RecoveryEnded) -> None:
    inc = d.memory.incident
    if inc is None or inc.id != done.incident:
        return
    if inc.phase == Phase.RESTARTING:  # the steps ended (or failed) between two passes: not said yet
        _steps_event(d, inc, done.steps)
    if done.ok:
        downtime = round((done.ready_at or d.wall) - inc.detected, 1)
        d.emit(inc, "recovered", downtime=downtime, detail=done.detail)
        d.notify(inc, "recovered", f"serving again after {downtime:.0f}s ({done.detail})",
                 {"kind": inc.kind.value, "downtime": downtime, "restart_took": round(done.steps_duration, 1),
                  "attempts": inc.attempts}, state="serving")
        _resolve(d, inc, "recovered")
        return
    inc = replace(inc, phase=Phase.OPEN, in_hand=False)  # a failed restart pages
    d.keep(inc, said="")
    d.save()
    d.emit(inc, "restart_failed", stage=done.stage, error=done.detail, attempt=inc.attempts)
    d.notify(inc, "restart_failed", f"{done.stage}: {done.detail}", {"kind": inc.kind.value, "stage": done.stage,
             "error": done.detail, "attempt": inc.attempts}, runbook=Runbook.RESTART_FAILED)


def _steps_event(d: Draft, inc: Incident, steps: StepsDone | None) -> None:
    """``restart_steps``: what ran, in order, on which node, and each node's /dev/shm check (names, bytes)."""
    if steps is not None:
        d.emit(inc, "restart_steps", ok=steps.ok, seconds=round(steps.seconds, 1), steps=[dict(x) for x in steps.steps],
               shm=[dict(r) for r in steps.shm])


def _resolve(d: Draft, inc: Incident, how: str) -> None:
    d.close(quiet_since=d.book.mono)
    d.save()
    lasted = round(d.wall - inc.detected, 1)
    d.emit(inc, "resolved", how=how, lasted=lasted)
    d.notify(inc, "resolved", how, {"kind": inc.kind.value, "lasted": lasted}, resolved=True)
