"""The incident machine (watchdog.act.incident_machine), pure: its transitions as a table, then random event
sequences that must keep its promises (never a second restart while one runs, never an alert for a closed
incident, always one phase, one id per incident)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from watchdog.act.incident_machine import step
from watchdog.act.incident_types import (
    ACTIVE,
    Book,
    Capture,
    Command,
    Emit,
    Event,
    GaveUp,
    Incident,
    Kind,
    Memory,
    Notify,
    Phase,
    Prove,
    RecoveryEnded,
    Restart,
    Resumed,
    Save,
    Say,
    Settings,
    Sighted,
    StacksSaid,
    StepsDone,
    Tick,
)
from watchdog.core.types import Decision, State, Verdict
from watchdog.nodes.liveness import NodeView

W0, M0 = 1_800_000_000.0, 1000.0  # wall and monotonic time of the first event
S = Settings("vllm", stall_window=40, down_after=10, boot_timeout=600, evidence_timeout=30, hold_max=300,
             blind_after=60, capture=True, down_bundles=True, has_steps=True, dry_run=False, supervised=False,
             on_boot_timeout=True, plan=("command /bin/restart",))
LOST = NodeView("worker1", "blind", "cannot see node worker1: ssh: connection timed out")
SEEN = NodeView("worker1", "ok", "2 rank(s) running on node worker1")


def verdict(state: State, since_ago: float = 0.0, at: float = M0, reason: str = "", only: bool = False,
            moved: float | str | None = "at") -> Verdict:
    """``moved``: when the judge last saw progress (mono, None: never); "at" is ``at`` for a working engine."""
    progress = (at if state == State.WORKING else None) if moved == "at" else moved
    assert not isinstance(progress, str)
    return Verdict("0", state, reason or f"{state.value} for the test", at - since_ago, at, last_progress=progress,
                   stacks_only=only)


def tick(state: State, since_ago: float = 0.0, at: float = M0, **kw: Any) -> Tick:
    only, moved = kw.pop("only", False), kw.pop("moved", "at")
    return Tick((verdict(state, since_ago, at, only=only, moved=moved),), at, kw.pop("paused", False), nonce="beef",
                **kw)


def said(commands: list[Command]) -> list[str]:
    """The commands, as the table writes them."""
    out = []
    for c in commands:
        if isinstance(c, Emit):
            out.append(f"event:{c.name}")
        elif isinstance(c, Notify):
            out.append(f"alert:{c.event}")
        else:
            out.append({Save: "save", Capture: "capture", Restart: "restart", Prove: "prove", Say: "say"}[type(c)])
    return out


def incident(phase: Phase = Phase.OPEN, kind: Kind = Kind.FROZEN, **kw: Any) -> Incident:
    return Incident("i-1", "0", kind, W0 - 10, "no progress", phase, **kw)


def book(inc: Incident | None = None, restarts: tuple[float, ...] = (), **kw: Any) -> Book:
    return Book(memory=Memory(restarts, kw.pop("gave_up", None), inc), mono=M0, **kw)


NOTHING: list[str] = []
HELD_SAID = "hold: the stacks show the engine working (moving between captures)"
OPENED = ["save", "event:incident_opened"]
RESTART = ["save", "event:restart_started", "alert:restart_started", "restart"]
RESOLVED = ["save", "event:resolved", "alert:resolved"]
STEPS = StepsDone(True, 12.0, ({"step": "command /bin/restart", "ok": True},))


@dataclass(frozen=True)
class Row:
    name: str
    book: Book
    event: Event
    commands: list[str]
    phase: Phase | None  # of the open incident after the step (None: none open)
    settings: Settings = S
    wall: float = W0


TABLE = [
    Row("idle: nothing", book(), tick(State.IDLE), NOTHING, None),
    Row("a suspicion opens nothing", book(), tick(State.SUSPECT, 6), NOTHING, None),
    Row("frozen: open, take its bundle, alert, wait for it", book(), tick(State.FROZEN, 45),
        [*OPENED, "capture", "alert:stall_detected"], Phase.EVIDENCE),
    Row("frozen, capture off: open and restart at once", book(), tick(State.FROZEN, 45),
        [*OPENED, "alert:stall_detected", *RESTART], Phase.RESTARTING, replace(S, capture=False)),
    Row("down for less than down_after: nothing yet", book(), tick(State.DOWN, 5), NOTHING, None),
    Row("down for down_after: open, its bundle, alert", book(), tick(State.DOWN, 11),
        [*OPENED, "capture", "alert:engine_down"], Phase.EVIDENCE),
    Row("down, supervised, no bundle taker: wait for the supervisor", book(), tick(State.DOWN, 11),
        [*OPENED, "alert:engine_down", "save", "event:awaiting_supervisor", "prove"], Phase.PROVING,
        replace(S, supervised=True, down_bundles=False)),
    Row("starting past the boot timeout: open and restart", book(), tick(State.STARTING, 601),
        [*OPENED, "alert:stall_detected", *RESTART], Phase.RESTARTING),
    Row("its bundle: alerted, the wait ends", book(incident(Phase.EVIDENCE)),
        StacksSaid("0", Decision.STUCK, "/b/i-1", {"headline": "every rank parked"}),
        ["save", "alert:evidence_captured"], Phase.OPEN),
    Row("a check's stacks for a freeze: kept, no alert", book(incident(Phase.EVIDENCE)),
        StacksSaid("0", Decision.WORKING, None, {}, final=False), ["save"], Phase.EVIDENCE),
    Row("another incident's bundle does not end a down one's wait", book(incident(Phase.EVIDENCE, Kind.DOWN)),
        StacksSaid("0", Decision.STUCK, "/b/x", {}, incident="other"), NOTHING, Phase.EVIDENCE),
    Row("waiting for the bundle: nothing decided", book(incident(Phase.EVIDENCE), evidence_until=M0 + 5),
        tick(State.FROZEN, 50), NOTHING, Phase.EVIDENCE),
    Row("the bundle never came: decided at the timeout", book(incident(Phase.EVIDENCE), evidence_until=M0),
        tick(State.FROZEN, 50), RESTART, Phase.RESTARTING),
    Row("the stacks show work: held", book(incident(evidence=Decision.WORKING)), tick(State.FROZEN, 50),
        ["save", "event:restart_held", "say"], Phase.HELD),
    Row("held past hold_max: restarted", book(incident(Phase.HELD, evidence=Decision.WORKING, held_since=W0 - 300),
                                              said="hold: the stacks show the engine working (moving between "
                                                   "captures)"),
        tick(State.FROZEN, 400), ["event:hold_ended", *RESTART], Phase.RESTARTING),
    Row("a restart not yet allowed: waiting", book(incident(), (W0 - 10,)), tick(State.FROZEN, 50),
        ["save", "event:restart_not_run", "say"], Phase.WAITING),
    Row("the budget spent: give up", book(incident(), (W0 - 1000, W0 - 900, W0 - 100)), tick(State.FROZEN, 50),
        ["save", "event:gave_up", "alert:gave_up"], Phase.GAVE_UP),
    Row("given up: then only watched", book(incident(Phase.GAVE_UP), (W0 - 1000, W0 - 900, W0 - 100),
                                            gave_up=GaveUp(W0 - 50, "i-1", "spent")), tick(State.FROZEN, 50),
        ["save", "event:restart_not_run", "say"], Phase.OBSERVING),
    Row("only watched: said once", book(incident(Phase.OBSERVING), gave_up=GaveUp(W0 - 50, "i-1", "spent"),
                                        said="observe: gave up earlier"), tick(State.FROZEN, 50), NOTHING,
        Phase.OBSERVING),
    Row("paused: not restarted, said once", book(incident()), tick(State.FROZEN, 50, paused=True),
        ["save", "event:restart_not_run", "say"], Phase.OBSERVING),
    Row("paused: a new incident's alert is not sent", book(), tick(State.FROZEN, 45, paused=True),
        [*OPENED, "capture", "event:alert_suppressed"], Phase.EVIDENCE),
    Row("dry run: described, not run", book(incident()), tick(State.FROZEN, 50),
        ["save", "event:restart_not_run", "say"], Phase.OBSERVING, replace(S, dry_run=True)),
    Row("the steps done: now proving", book(incident(Phase.RESTARTING, attempts=1)),
        tick(State.DOWN, 5, recovering=Phase.PROVING, steps=STEPS), ["save", "event:restart_steps"], Phase.PROVING),
    Row("restarting: nothing else decided", book(incident(Phase.RESTARTING, attempts=1)),
        tick(State.DOWN, 5, recovering=Phase.RESTARTING), NOTHING, Phase.RESTARTING),
    Row("recovered: resolved", book(incident(Phase.PROVING, attempts=1)),
        tick(State.IDLE, ended=RecoveryEnded("i-1", True, "ready", "one token", W0 - 1, 5.0)),
        ["event:recovered", "alert:recovered", *RESOLVED], None),
    Row("a step failed: paged, back to deciding (the backoff)",
        book(incident(Phase.RESTARTING, attempts=1, in_hand=True), (W0 - 5,)),
        tick(State.DOWN, 5, ended=RecoveryEnded("i-1", False, "steps", "exit 1", steps=replace(STEPS, ok=False))),
        ["event:restart_steps", "save", "event:restart_failed", "alert:restart_failed",
         "save", "event:restart_not_run", "say"], Phase.WAITING),
    Row("another incident's recovery: ignored", book(incident(Phase.PROVING, attempts=1)),
        tick(State.DOWN, 5, recovering=Phase.PROVING, ended=RecoveryEnded("i-0", True, "ready", "x")), NOTHING,
        Phase.PROVING),
    Row("progress again: resolved without a restart", book(incident()), tick(State.WORKING), RESOLVED, None),
    Row("work nothing was seen to move of (a new watcher's first page): not cleared", book(incident(Phase.OBSERVING),
        said="x"), tick(State.WORKING, moved=None), NOTHING, Phase.OBSERVING),
    Row("progress seen before the incident opened does not clear it", book(incident(Phase.OBSERVING), said="x"),
        tick(State.WORKING, moved=M0 - 30), NOTHING, Phase.OBSERVING),
    Row("stacks alone do not clear it", book(incident(Phase.OBSERVING), said="x"), tick(State.WORKING, only=True),
        NOTHING, Phase.OBSERVING),
    Row("a freeze begun before the last incident ended is spent", book(quiet_since=M0 - 5), tick(State.FROZEN, 20),
        NOTHING, None),
    Row("resumed mid-restart: waits, never restarts", book(incident(Phase.RESTARTING, attempts=1,
                                                                    restart_started=W0 - 5)),
        Resumed(), ["say", "event:incident_resumed", "save", "prove"], Phase.PROVING),
    Row("resumed with nothing open: nothing", book(), Resumed(), NOTHING, None),
    # a step of the wall clock (NTP on a host whose clock was off) moves no wait: they are on the judge's clock
    Row("the wall clock stepped on an hour: the bundle still awaited", book(incident(Phase.EVIDENCE),
        evidence_until=M0 + 5), tick(State.FROZEN, 50), NOTHING, Phase.EVIDENCE, wall=W0 + 3600),
    Row("the wall clock stepped on an hour: still held", book(incident(Phase.HELD, evidence=Decision.WORKING,
        held_since=W0 - 10), held_mono=("i-1", M0 - 10), said=HELD_SAID), tick(State.FROZEN, 400), NOTHING, Phase.HELD,
        wall=W0 + 3600),
    Row("the wall clock stepped back an hour: held past hold_max, restarted", book(incident(Phase.HELD,
        evidence=Decision.WORKING, held_since=W0 - 300), held_mono=("i-1", M0 - 300), said=HELD_SAID),
        tick(State.FROZEN, 400), ["event:hold_ended", *RESTART], Phase.RESTARTING, wall=W0 - 3600),
    Row("the wall clock stepped on an hour: progress from before the opening still does not clear it",
        book(incident(Phase.OBSERVING), said="x", opened_mono=("i-1", M0 - 10)), tick(State.WORKING, moved=M0 - 30),
        NOTHING, Phase.OBSERVING, wall=W0 + 3600),
    Row("the wall clock stepped back an hour: progress since the opening clears it",
        book(incident(Phase.OBSERVING), said="x", opened_mono=("i-1", M0 - 10)), tick(State.WORKING, moved=M0 - 5),
        RESOLVED, None, wall=W0 - 3600),
    Row("a node unseen for blind_after: a blind incident beside", book(unseen_since={"node:worker1": M0 - 60}),
        Sighted((verdict(State.IDLE),), (LOST,), M0, False, "beef"),
        ["save", "say", "event:incident_opened", "alert:blind"], None),
]


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_each_transition(row: Row) -> None:
    after, commands = step(row.book, row.event, row.settings, row.wall)
    assert said(commands) == row.commands
    inc = after.memory.incident
    assert (inc.phase if inc else None) == row.phase
    assert step(row.book, row.event, row.settings, row.wall) == (after, commands)  # the same inputs, the same out


def test_an_incident_has_its_id_from_the_moment_it_opens() -> None:
    after, commands = step(book(), tick(State.FROZEN, 45), S, W0)
    inc = after.memory.incident
    assert inc is not None and inc.id == "20270115T080000Z-vllm-engine0-frozen-beef"
    assert {c.incident.id for c in commands if isinstance(c, Emit | Notify | Capture)} == {inc.id}


def test_a_blind_incident_resolves_when_seen_and_never_restarts() -> None:
    b, _ = step(book(unseen_since={"node:worker1": M0 - 60}), Sighted((verdict(State.IDLE),), (LOST,), M0, False,
                                                                      "beef"), S, W0)
    [blind] = b.memory.blind
    assert blind.kind == Kind.BLIND and blind.unseen == "node:worker1" and b.memory.incident is None
    b, commands = step(b, Sighted((verdict(State.IDLE, at=M0 + 5),), (SEEN,), M0 + 5, False), S, W0 + 5)
    assert said(commands) == ["save", "say", "event:resolved", "alert:resolved"] and b.memory.blind == ()
    assert not any(isinstance(c, Restart | Prove) for c in commands)


@pytest.mark.parametrize(("started", "left"), [(W0 - 5, 595.0), (W0 - 700, 0.0), (W0 + 3600, 600.0)])
def test_a_resumed_recovery_waits_what_is_left_of_one_boot_timeout(started: float, left: float) -> None:
    """The walls of an earlier life are read once: what is left of the boot timeout, never more than one (the
    clock stepped back since) nor less than nothing."""
    _, commands = step(book(incident(Phase.RESTARTING, attempts=1, restart_started=started)), Resumed(), S, W0)
    [job] = [c.job for c in commands if isinstance(c, Prove)]
    assert job.timeout == left and not job.restart


def test_a_restart_waits_one_boot_timeout_whatever_the_wall_clock_says() -> None:
    _, commands = step(book(incident(), said="x"), tick(State.FROZEN, 50), S, W0 + 3600)
    [job] = [c.job for c in commands if isinstance(c, Restart)]
    assert job.timeout == S.boot_timeout and job.restart


def test_walls_ahead_of_a_clock_stepped_back_count_from_now() -> None:
    """Found by the storm (seed 528390879): a restart issued while the wall clock was an hour ahead, the clock then
    stepped back, held the next incident's restart for an hour of backoff. It is moved to now, once: one backoff."""
    ahead = book(incident(Kind.DOWN), restarts=(W0 + 3600,), said="x")
    b, commands = step(ahead, tick(State.DOWN, 50), S, W0)
    assert b.memory.restarts == (W0,)
    assert "say" in said(commands) and not any(isinstance(c, Restart) for c in commands)
    assert any(isinstance(c, Emit) and c.fields.get("choice") == "wait" and "in 60s" in c.fields["reason"]
               for c in commands), said(commands)
    b, commands = step(b, tick(State.DOWN, 111, at=M0 + 61), S, W0 + 61)
    assert any(isinstance(c, Restart) for c in commands), said(commands)
    gave = book(gave_up=GaveUp(W0 + 3600, "i-0", "budget spent"))
    b, _ = step(gave, tick(State.IDLE), S, W0)
    assert b.memory.gave_up is not None and b.memory.gave_up.at == W0  # so a reset from now on clears it
    assert step(b, tick(State.IDLE), S, W0)[1] == []  # moved once: nothing more to say


# -- random sequences ------------------------------------------------------------------------------------------------

STATES = [State.IDLE, State.WORKING, State.SUSPECT, State.STARTING, State.BLIND, *[State.FROZEN, State.DOWN] * 3]
rarely = st.sampled_from([False] * 7 + [True])
ticks = st.tuples(st.just("tick"), st.sampled_from(STATES), st.sampled_from([0.0, 6, 11, 45, 601]), rarely, rarely)
ends = st.tuples(st.just("end"), st.booleans(), st.sampled_from(["steps", "ready"]))
moves = st.one_of(
    ticks, ticks, ticks, ticks, ends, ends,
    st.tuples(st.just("stacks"), st.sampled_from([*Decision, None]), st.booleans(), st.booleans()),
    st.tuples(st.just("proving")),
    st.tuples(st.just("sight"), st.booleans()),
    st.tuples(st.just("resume")),
)
steps = st.sampled_from([0.0] * 12 + [3600.0, -3600.0])  # now and then the wall clock steps (the monotonic one never)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(moves, st.sampled_from([1.0, 5, 31, 120, 400]), steps), min_size=30, max_size=80),
       st.booleans(), rarely)
def test_random_event_sequences_keep_the_promises(seq: list[tuple[tuple[Any, ...], float, float]], capture: bool,
                                                  supervised: bool) -> None:
    s = replace(S, capture=capture, down_bundles=capture, supervised=supervised)
    b, wall, mono = Book(), W0, M0
    running: str | None = None  # the incident whose recovery runs (the edge runs one at a time)
    recovering = Phase.RESTARTING
    closed: set[str] = set()
    opened: list[str] = []
    for n, (move, dt, jump) in enumerate(seq):
        wall, mono = wall + dt + jump, mono + dt
        ev: Event
        if move[0] == "tick":
            _, state, ago, paused, only = move
            ev = Tick((verdict(state, ago, mono, only=only),), mono, paused, nonce=f"{n:04x}",
                      recovering=recovering if running else None)
        elif move[0] == "stacks":
            inc = b.memory.incident
            _, decision, final, its_own = move
            ev = StacksSaid("0", decision, "/b", {"headline": "h"}, final, inc.id if inc and its_own else "x")
        elif move[0] == "end":
            if running is None:
                continue
            ev = Tick((verdict(State.IDLE if move[1] else State.DOWN, 0, mono),), mono, False, nonce=f"{n:04x}",
                      ended=RecoveryEnded(running, move[1], move[2], "detail", wall if move[1] else None))
            running, recovering = None, Phase.RESTARTING
        elif move[0] == "proving":
            recovering = Phase.PROVING
            continue
        elif move[0] == "sight":
            ev = Sighted((verdict(State.IDLE, 0, mono),), (LOST if move[1] else SEEN,), mono, False, f"{n:04x}")
        else:
            if running is not None:
                continue  # a restarted watchdog has no recovery running: only the memory survives
            b, ev = Book(memory=b.memory), Resumed()
        b, commands = step(b, ev, s, wall)
        for c in commands:
            if isinstance(c, Restart | Prove):
                assert running is None, f"a second recovery for {c.job.incident} while {running}'s runs"
                running = c.job.incident
                event(type(c).__name__)  # how often the sequences reach a recovery: --hypothesis-show-statistics
            if isinstance(c, Emit | Notify):
                assert c.incident.id not in closed, f"{c} for a closed incident"
            if isinstance(c, Emit) and c.name == "incident_opened":
                assert c.incident.id not in opened, "one id per incident"
                opened.append(c.incident.id)
                event("opened")
        for c in commands:
            if isinstance(c, Emit) and c.name == "resolved":
                closed.add(c.incident.id)
        inc = b.memory.incident
        if inc is not None:
            assert isinstance(inc.phase, Phase) and inc.kind != Kind.BLIND
            assert (inc.phase in ACTIVE) == (running == inc.id), (inc.phase, running)
            assert len(s and [t for t in b.memory.restarts if wall - t < s.budget_window]) <= s.budget
        assert len({x.unseen for x in b.memory.blind}) == len(b.memory.blind)
        assert all(x.kind == Kind.BLIND and x.phase in (Phase.OPEN, Phase.FROZEN_HERE) for x in b.memory.blind)
