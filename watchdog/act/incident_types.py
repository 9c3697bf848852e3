"""The incident machine's vocabulary: what an incident is, what goes in (events) and what comes out (commands).

Pure data, no I/O. `watchdog.act.incident_machine` turns a `Book` and one event into a new `Book` and a list of
commands; the edges (`watchdog.act.respond`) read the world into events and carry the commands out: save the
memory, write an event, send an alert, ask for a bundle, start a restart or wait for the engine to serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from watchdog.act.blind import Unseen
from watchdog.core.runbooks import Runbook
from watchdog.core.types import Decision, Verdict
from watchdog.nodes.liveness import NodeView


class Kind(StrEnum):
    FROZEN = "frozen"
    DOWN = "down"
    BOOT_TIMEOUT = "boot_timeout"  # starting for longer than restart.boot_timeout
    BLIND = "blind"  # the page or a node cannot be seen: never acted on


class Phase(StrEnum):
    OPEN = "open"  # deciding each pass
    EVIDENCE = "evidence"  # waiting for its bundle (at most restart.evidence_timeout)
    HELD = "held"  # the stacks show work: the restart waits (at most restart.hold_max)
    WAITING = "waiting"  # backoff before the next restart
    OBSERVING = "observing"  # nothing to do: paused, dry run, alert only
    RESTARTING = "restarting"  # the restart steps run
    PROVING = "proving"  # waiting for the first successful generation
    GAVE_UP = "gave_up"  # the budget is spent: a human is needed
    FROZEN_HERE = "frozen_here"  # blind: a node is not seen and the freeze here was said


ACTIVE = frozenset({Phase.RESTARTING, Phase.PROVING})  # a recovery runs: nothing else is decided


@dataclass(frozen=True, slots=True)
class Incident:
    id: str  # the one id of its bundle, events, alerts and status, from the moment it opens
    engine: str
    kind: Kind
    detected: float  # wall time
    reason: str = ""
    phase: Phase = Phase.OPEN
    attempts: int = 0  # restarts issued for it
    restart_started: float | None = None  # wall time of the restart in flight
    bundle: str | None = None
    evidence: Decision | None = None  # what its stacks decided (a freeze's)
    held_since: float | None = None  # wall time the restart was first held by stacks that show work
    unseen: str = ""  # blind: "page" or "node:<name>"
    in_hand: bool = False  # restarted within the budget (alerts a warning) until a restart fails or it ends


@dataclass(frozen=True, slots=True)
class RecoveryJob:
    incident: str
    restart: bool  # False: only wait for the engine to serve (its supervisor restarts it, or we were restarted)
    timeout: float  # seconds from the job's start (the runner's monotonic clock) by which the engine must serve


@dataclass(frozen=True, slots=True)
class StepsDone:
    """What the restart steps did: in order, on which node, and each node's /dev/shm check."""

    ok: bool
    seconds: float
    steps: tuple[Mapping[str, Any], ...]  # what ran, in order: commands and the /dev/shm check
    shm: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class GaveUp:
    at: float  # wall time
    incident: str
    reason: str


@dataclass(frozen=True, slots=True)
class Memory:
    """What survives a restart of the watchdog (``recovery.json``)."""

    restarts: tuple[float, ...] = ()  # wall times of the restarts issued
    gave_up: GaveUp | None = None  # until `watchdog reset`
    incident: Incident | None = None  # the one incident the restart policy acts on
    blind: tuple[Incident, ...] = ()  # open blind incidents, one per thing not seen


@dataclass(frozen=True, slots=True)
class Settings:
    """What the machine needs of the config."""

    stack: str  # engine.name, in every id
    stall_window: float
    down_after: float
    boot_timeout: float
    evidence_timeout: float
    hold_max: float
    blind_after: float
    capture: bool  # a freeze's bundle is taken (and waited for)
    down_bundles: bool  # a down engine's bundle is taken (and waited for)
    has_steps: bool
    dry_run: bool
    supervised: bool
    on_boot_timeout: bool
    budget: int = 3
    budget_window: float = 3600.0
    backoff_initial: float = 60.0
    backoff_max: float = 900.0
    plan: tuple[str, ...] = ()  # the restart plan, as said in events


@dataclass(frozen=True, slots=True)
class Book:
    """The machine's whole state: the memory, and what it keeps between passes."""

    memory: Memory = Memory()
    paused: bool = False  # the operator's pause, as of the last event
    reset_at: float = 0.0  # restarts and a give-up before this (wall) no longer count
    verdicts: Mapping[str, Verdict] = field(default_factory=dict)  # the last pass's, by engine
    mono: float = 0.0  # the last pass's monotonic time (the judge's clock)
    said: str = ""  # the last decision announced for the open incident (each said once)
    quiet_since: float | None = None  # monotonic time the last incident ended: verdicts begun before are spent
    evidence_until: float = 0.0  # monotonic time the open incident stops waiting for its bundle
    # (incident id, monotonic time) it opened and its restart was first held, in this process: durations on the
    # judge's clock, which a step of the wall clock does not move (an incident resumed from disk has only walls)
    opened_mono: tuple[str, float] | None = None
    held_mono: tuple[str, float] | None = None
    stacks_said: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # engine -> (headline, runbook)
    unseen_since: Mapping[str, float] = field(default_factory=dict)  # blind: what -> monotonic time first unseen
    unseen: tuple[Unseen, ...] = ()  # blind: everything not seen in the last pass of sight


# -- events: what the edges tell the machine ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resumed:
    """The watchdog started with this memory."""


@dataclass(frozen=True, slots=True)
class RecoveryEnded:
    """The recovery of ``incident`` ended: serving (``ok``) or not, and why."""

    incident: str
    ok: bool
    stage: str  # "steps" (a restart step failed) or "ready" (serving, or not by the deadline)
    detail: str
    ready_at: float | None = None  # wall time of the first successful generation
    steps_duration: float = 0.0
    steps: StepsDone | None = None  # None: no restart steps were run


@dataclass(frozen=True, slots=True)
class Tick:
    """One pass: the verdicts (other nodes' overlaid), the operator's switches, and the recovery's phase."""

    verdicts: tuple[Verdict, ...]
    mono: float
    paused: bool
    reset_at: float = 0.0
    nonce: str = "0000"  # a few random hex digits for the id of an incident opened now
    recovering: Phase | None = None  # the running recovery's phase: RESTARTING or PROVING
    steps: StepsDone | None = None  # the restart steps' outcome, once they are done
    ended: RecoveryEnded | None = None  # the recovery that ended since the last pass


@dataclass(frozen=True, slots=True)
class Sighted:
    """One pass of sight: this node's own verdicts and the other nodes' views."""

    local: tuple[Verdict, ...]
    views: tuple[NodeView, ...]
    mono: float
    paused: bool
    nonce: str = "0000"


@dataclass(frozen=True, slots=True)
class StacksSaid:
    """What the stacks said of an engine. ``final``: a bundle (or its failure) for ``incident``."""

    engine: str
    decision: Decision | None
    bundle: str | None
    details: Mapping[str, Any]
    final: bool = True
    incident: str = ""


Event = Resumed | Tick | Sighted | StacksSaid


# -- commands: what the machine asks the edges to do, in order -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Save:
    """Write the memory (before any command after it acts)."""


@dataclass(frozen=True, slots=True)
class Emit:
    """An event record for ``events.jsonl`` about ``incident``."""

    name: str
    incident: Incident
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Notify:
    """An alert about ``incident`` (the machine has checked it is not paused)."""

    event: str
    incident: Incident
    summary: str
    details: Mapping[str, Any]
    state: str
    resolved: bool = False
    runbook: Runbook | None = None


@dataclass(frozen=True, slots=True)
class Capture:
    """Take ``incident``'s bundle (a freeze's stacks, or a down engine's log cause)."""

    incident: Incident


@dataclass(frozen=True, slots=True)
class Restart:
    job: RecoveryJob


@dataclass(frozen=True, slots=True)
class Prove:
    """Wait for the engine to serve (its supervisor restarts it, or a restart was in flight when we started)."""

    job: RecoveryJob


@dataclass(frozen=True, slots=True)
class Say:
    """A warning for the log."""

    text: str


Command = Save | Emit | Notify | Capture | Restart | Prove | Say
