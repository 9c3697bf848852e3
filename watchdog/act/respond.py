"""The incident machine's edge: the world read into its events, its commands carried out.

Each pass the act stage calls `Responder.sight` (this node's own verdicts and the other nodes' views) and then
`Responder.step` (the verdicts, overlaid); stack evidence arrives through `Responder.evidence` as it is taken.
Every decision is `watchdog.act.incident_machine.step`'s; this class only holds its `Book` and does what it says:
``Save`` writes ``recovery.json`` (before anything after it acts: a watchdog restarted mid-recovery resumes waiting
instead of restarting again), ``Emit`` writes an event, ``Notify`` sends an alert, ``Capture`` asks for an
incident's bundle, ``Restart`` and ``Prove`` start the recovery in the background, ``Say`` logs.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from watchdog.act import incident_machine
from watchdog.act.alerts import Alert, AlertSender
from watchdog.act.incident_types import (
    Book,
    Capture,
    Command,
    Emit,
    Event,
    Incident,
    Memory,
    Notify,
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
from watchdog.act.restart import Recoverer, RecoveryDone, RestartOutcome
from watchdog.act.state import Control, ControlFile, load_memory, save_memory
from watchdog.config.load import Config
from watchdog.core.runbooks import runbook_link
from watchdog.core.types import Decision, Verdict, base_url, calm
from watchdog.nodes.liveness import NodeView

log = logging.getLogger(__name__)

# With no incident, no recovery and every engine idle or working there is nothing to act on: the operator's switches
# are looked at every quarter minute (for the status and the exporter; `watchdog status` reads them itself), and on
# every pass again from the first sign of trouble, before anything is done. A stat costs ~80 us of CPU when cold.
CONTROL_CALM_EVERY = 15.0

Bundle = Callable[[Incident], None]  # take this incident's bundle (its kind says which)


def settings(cfg: Config, plan: Sequence[str] = (), down_bundles: bool = True) -> Settings:
    """``down_bundles``: a down engine's bundle is taken (and waited for); a freeze's is whenever capture is on."""
    r, capture = cfg.restart, cfg.capture.enabled
    return Settings(cfg.engine.name, cfg.judge.stall_window, r.down_after, r.boot_timeout, r.evidence_timeout,
                    r.hold_max, cfg.alerts.blind_after, capture, capture and down_bundles, bool(r.steps), r.dry_run,
                    r.supervised, r.on_boot_timeout, r.budget, r.budget_window, r.backoff_initial, r.backoff_max,
                    tuple(plan))


def steps_done(outcome: RestartOutcome | None) -> StepsDone | None:
    if outcome is None:
        return None
    return StepsDone(outcome.ok, outcome.duration, tuple(outcome.steps), tuple(r.record() for r in outcome.shm))


def ended(done: RecoveryDone) -> RecoveryEnded:
    return RecoveryEnded(done.job.incident, done.ok, done.stage, done.detail, done.ready_at, done.steps_duration,
                         steps_done(done.outcome))


class Responder:
    def __init__(self, cfg: Config, state_dir: Path, alerts: AlertSender, recovery: Recoverer,
                 event: Callable[[dict[str, Any]], None], plan: list[str] | None = None,
                 wall: Callable[[], float] = time.time, bundle: Bundle | None = None) -> None:
        """``bundle(incident)`` takes a freeze's or a down engine's bundle (None: capture is off)."""
        self.cfg, self.state_dir = cfg, state_dir
        self.alerts, self.recovery, self.event, self.wall = alerts, recovery, event, wall
        self.plan = plan or []
        self.bundle = bundle
        self.book = Book(memory=load_memory(state_dir))
        self.control = Control()
        self._control_file, self._control_read_at = ControlFile(state_dir), float("-inf")
        self._sight_at = (0.0, 0.0)  # (mono, wall) of the last pass of sight

    @property
    def bundle(self) -> Bundle | None:
        return self._bundle

    @bundle.setter
    def bundle(self, bundle: Bundle | None) -> None:
        """Who takes bundles: a down engine's is waited for only when someone does."""
        self._bundle = bundle
        self.settings = settings(self.cfg, self.plan, down_bundles=bundle is not None)

    @property
    def memory(self) -> Memory:
        return self.book.memory

    # -- events in ---------------------------------------------------------------------------------------------

    def resume(self) -> None:
        """After a restart of the watchdog: an incident caught mid-recovery goes on waiting, never restarts."""
        self._feed(Resumed())

    def sight(self, local: Sequence[Verdict], views: Sequence[NodeView], mono: float) -> None:
        """Before `step` (sight back is said before what it then shows): ``local`` this node's own verdicts."""
        wall = self.wall()
        self._sight_at = (mono, wall)
        if not self.watching and not any(v.state.value == "blind" for v in local) \
                and not any(v.status == "blind" for v in views):
            return  # all seen and nothing open: nothing to rule
        self._read_control()
        self._feed(Sighted(tuple(local), tuple(views), mono, self.control.is_paused(wall), secrets.token_hex(2)),
                   wall)

    def step(self, verdicts: Sequence[Verdict], mono: float) -> None:
        quiet = self.memory.incident is None and self.recovery.progress is None and calm(list(verdicts))
        if not quiet or mono - self._control_read_at >= CONTROL_CALM_EVERY or mono < self._control_read_at:
            self._read_control()  # before anything is acted on: every pass unless all is calm
            self._control_read_at = mono
        done = self.recovery.poll()
        progress = self.recovery.progress
        now = self.wall()
        self._feed(Tick(tuple(verdicts), mono, self.control.is_paused(now), self.control.reset_at,
                        secrets.token_hex(2), progress.phase if progress else None,
                        steps_done(progress.outcome) if progress else None,
                        ended(done) if done is not None else None), now)

    def evidence(self, engine: str, decision: Decision | str | None, bundle: str | None,
                 details: Mapping[str, Any], final: bool = True, incident: str = "") -> None:
        """What the stacks said: ``final`` for an incident's bundle (or its failure); a check's otherwise."""
        said = Decision(decision) if decision is not None else None
        self._feed(StacksSaid(engine, said, bundle, dict(details), final, incident))

    def _read_control(self) -> None:
        """The operator's switches as of now (a stat; parsed only when the file changed)."""
        self.control = self._control_file.read()

    # -- commands out ------------------------------------------------------------------------------------------

    def _feed(self, event: Event, wall: float | None = None) -> None:
        self.book, commands = incident_machine.step(self.book, event, self.settings,
                                                    self.wall() if wall is None else wall)
        for c in commands:
            self._do(c)

    def _do(self, c: Command) -> None:
        if isinstance(c, Save):
            self._save()
        elif isinstance(c, Emit):
            inc = c.incident
            self.event({"event": c.name, "incident": inc.id, "engine": inc.engine, "kind": inc.kind.value,
                        **c.fields})
        elif isinstance(c, Notify):
            self._alert(c)
        elif isinstance(c, Capture):
            if self.bundle is not None:
                self.bundle(c.incident)
        elif isinstance(c, Restart | Prove):
            self.recovery.start(c.job)
        elif isinstance(c, Say):
            log.warning("%s", c.text)

    def _save(self) -> None:
        try:
            save_memory(self.state_dir, self.memory)
        except OSError as e:
            log.error("cannot write the recovery state to %s: %s (a restarted watchdog will not know it)",
                      self.state_dir, e.strerror)

    def _alert(self, c: Notify) -> None:
        inc = c.incident
        self.alerts.submit(Alert(c.event, inc.id, inc.engine, self.cfg.engine.name, base_url(self.cfg.engine.url),
                                 c.state, c.summary, dict(c.details), self.wall(), c.resolved,
                                 "" if c.runbook is None else runbook_link(c.runbook, self.cfg.alerts.runbook_base),
                                 "warning" if inc.in_hand else "critical"))

    # -- what it says ------------------------------------------------------------------------------------------

    @property
    def watching(self) -> bool:
        """Something is not seen, or a blind incident is open: every pass of sight counts."""
        return bool(self.book.unseen_since or self.memory.blind)

    def blind_status(self) -> list[dict[str, Any]]:
        """What cannot be seen now, since when, and its incident (``status.json`` ``blind``; the exporter's
        ``watchdog_blind_seconds``)."""
        mono, wall = self._sight_at
        open_ = {b.unseen: b for b in self.memory.blind}
        since = self.book.unseen_since
        return [{"what": u.what, "unseen": u.name, "why": u.why, "since": wall - (mono - since.get(u.what, mono)),
                 "seconds": round(mono - since.get(u.what, mono), 1),
                 "incident": b.id if (b := open_.get(u.what)) else None, "engine": b.engine if b else None}
                for u in self.book.unseen]

    def status(self, now: float) -> dict[str, Any]:
        m, progress, budget = self.memory, self.recovery.progress, incident_machine.budget(self.settings)
        inc = m.incident
        return {
            "incident": None if inc is None else {"id": inc.id, "engine": inc.engine, "kind": inc.kind.value,
                                                  "phase": inc.phase.value, "attempts": inc.attempts,
                                                  "bundle": inc.bundle, "in_hand": inc.in_hand},
            "recovery": None if progress is None else {"phase": progress.phase,
                                                       "seconds": round(now - progress.since, 1),
                                                       "since": progress.since,
                                                       "tries": progress.tries, "last_try": progress.last_try},
            "paused": self.control.is_paused(now), "paused_until": self.control.paused_until,
            "pause_reason": self.control.reason,
            "budget_left": budget.left(m.restarts, now, self.control.reset_at),
            "budget": self.settings.budget, "gave_up": asdict(m.gave_up) if m.gave_up else None,
            "dry_run": self.settings.dry_run, "restart_configured": self.settings.has_steps,
        }
