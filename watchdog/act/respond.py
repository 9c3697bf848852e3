"""The act stage: incidents from verdicts, alerts, and the restart decision, one stack at a time.

Every pass the daemon hands over the judge's verdicts. An incident opens when an engine is frozen, down for
``down_after`` seconds, or starting for longer than the boot timeout. Then, in order:

1. alert (``stall_detected`` or ``engine_down``); a freeze waits for its stacks (``evidence_captured``) at most
   ``evidence_timeout`` seconds;
2. confirm it is still bad with this pass's verdicts, and ask the policy (`watchdog.act.policy.choose`): restart, wait
   (backoff), hold (the stacks show work), give up (budget spent), or only watch (paused, dry run, nothing
   configured);
3. a restart runs in the background (`watchdog.act.recovery`); the policy is paused for the stack until the engine
   serves again (``recovered``, then ``resolved``) or not (``restart_failed``, and back to 2).

An incident that clears by itself is ``resolved``. The open incident and the restarts issued are written to the
state directory before anything is acted on, so a watchdog restarted mid-recovery resumes waiting instead of
restarting again. While paused nothing is acted on and no alert is sent; events are still written.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.act.alerts import Alert, AlertSender
from watchdog.act.policy import Budget, Choice, Ruling, choose, in_hand
from watchdog.act.recovery import Recoverer, RecoveryDone, RecoveryJob
from watchdog.act.restart import RestartOutcome
from watchdog.act.state import Control, ControlFile, Incident, Memory, load_memory, save_memory
from watchdog.config.load import Config
from watchdog.core.runbooks import Runbook, runbook_link
from watchdog.core.types import State, Verdict, base_url, calm, incident_id
from watchdog.evidence.explain.log_cause import down_runbook

log = logging.getLogger(__name__)

ACTIVE = ("restarting", "proving")


# With no incident, no recovery and every engine idle or working there is nothing to act on: the operator's switches
# are looked at every quarter minute (for the status and the exporter; `watchdog status` reads them itself), and on
# every pass again from the first sign of trouble, before anything is done. A stat costs ~80 us of CPU when cold.
CONTROL_CALM_EVERY = 15.0


class Responder:
    def __init__(self, cfg: Config, state_dir: Path, alerts: AlertSender, recovery: Recoverer,
                 event: Callable[[dict[str, Any]], None], plan: list[str] | None = None,
                 wall: Callable[[], float] = time.time, bundle: Callable[[str, str, str], None] | None = None) -> None:
        """``bundle(engine, incident id, reason)`` asks for a down incident's bundle (None: capture is off)."""
        self.cfg, self.r, self.state_dir, self.bundle = cfg, cfg.restart, state_dir, bundle
        self.alerts, self.recovery, self.event, self.wall = alerts, recovery, event, wall
        self.plan = plan or []
        self.budget = Budget.of(cfg.restart)
        self.memory: Memory = load_memory(state_dir)
        self.control = Control()
        self._evidence_wait_until = 0.0
        self._said = ""  # the last decision announced for the open incident (announce each once)
        self._verdicts: dict[str, Verdict] = {}
        self._mono = 0.0
        self._quiet_since: float | None = None  # monotonic time the last incident ended: older verdicts are spent
        self._control_file, self._control_read_at = ControlFile(state_dir), float("-inf")
        self._reserved: dict[str, str] = {}  # engine -> the id its freeze's bundle took before the incident opened
        self._stacks_said: dict[str, tuple[str, str]] = {}  # engine -> (headline, runbook) of stacks found stuck

    # -- the pass --------------------------------------------------------------------------------------

    def resume(self) -> None:
        """After a restart of the watchdog: an incident caught mid-recovery goes on waiting, never restarts."""
        inc = self.memory.incident
        if inc is None:
            return
        log.warning("resuming incident %s (%s, phase %s) from %s", inc.id, inc.kind, inc.phase, self.state_dir)
        self._event(inc, "incident_resumed", phase=inc.phase)
        if inc.phase in ACTIVE:
            started = inc.restart_started or inc.detected
            inc.phase = "proving"
            self._save()
            self.recovery.start(RecoveryJob(inc.id, False, started + self.r.boot_timeout))

    @property
    def reserved(self) -> bool:
        """An id is held for a freeze's bundle (its incident opens on the next pass)."""
        return bool(self._reserved)

    def id_for(self, engine: str, wall: float) -> str:
        """The one id of this engine's freeze: the open incident's, or one reserved for the incident that opens
        next (a freeze's bundle can be asked for in the pass before its incident opens)."""
        inc = self.memory.incident
        if inc is not None and inc.engine == engine and inc.kind == "frozen":
            return inc.id
        if engine not in self._reserved:
            self._reserved[engine] = incident_id(wall, self.cfg.engine.name, engine, "frozen", secrets.token_hex(2))
        return self._reserved[engine]

    def step(self, verdicts: list[Verdict], mono: float) -> None:
        now = self.wall()
        quiet = self.memory.incident is None and self.recovery.progress is None and calm(verdicts)
        if not quiet or mono - self._control_read_at >= CONTROL_CALM_EVERY or mono < self._control_read_at:
            self._read_control()  # before anything is acted on: every pass unless all is calm
            self._control_read_at = mono
        self._verdicts, self._mono = {v.engine: v for v in verdicts}, mono
        for engine in [e for e in self._reserved if e not in self._verdicts or self._verdicts[e].state != State.FROZEN]:
            del self._reserved[engine]  # that freeze is over: its id is not for a later one
        if (done := self.recovery.poll()) is not None:
            self._recovery_done(done, now)
        inc = self.memory.incident
        if inc is None:
            if (opened := self._trouble(verdicts, mono)) is not None:
                self._open(*opened, now)
            return
        if inc.phase in ACTIVE:
            progress = self.recovery.progress
            if inc.phase == "restarting" and progress is not None and progress.phase == "proving":
                inc.phase = "proving"  # the steps are done: now waiting for the first generation
                self._save()
                self._steps_event(inc, progress.outcome)
            return  # judgement of this stack is paused until the recovery reports
        if self._cleared(inc):
            self._resolve(inc, now, "the engine serves again without a restart")
            return
        if inc.phase == "evidence" and now < self._evidence_wait_until:
            return
        if self._confirmed(inc):
            self._decide(inc, now)

    def evidence(self, engine: str, decision: str | None, bundle: str | None, details: dict[str, Any],
                 final: bool = True, incident: str = "") -> None:
        """The freeze's stacks: ``decision`` stuck | working | undecided, None when not taken. ``final``: the freeze's
        own bundle (or its failure), which the incident waits for; a check before it is kept (stuck: for its alert).
        A down incident's bundle (its log's cause; what is left running) only ends its wait: no stacks hold it."""
        inc, said = self.memory.incident, (str(details.get("headline") or ""), str(details.get("runbook") or ""))
        ours = inc is not None and inc.engine == engine and (
            inc.kind == "frozen" or (inc.kind == "down" and final and incident == inc.id))  # a down one: its bundle
        if inc is None or not ours:
            self._stacks_said[engine] = said if decision == "stuck" else ("", "")
            return
        inc.evidence = (decision or inc.evidence) if inc.kind == "frozen" else None
        inc.bundle = bundle or inc.bundle
        if final and inc.phase == "evidence":
            inc.phase = "open"
        self._save()
        if final:
            self._alert(inc, "evidence_captured", said[0] or f"stacks: {decision or 'not taken'}", {"kind": inc.kind,
                        "verdict": decision, "bundle": bundle, **details}, runbook=Runbook(said[1] or Runbook.FROZEN))

    def _read_control(self) -> None:
        """The operator's switches as of now (a stat; parsed only when the file changed)."""
        self.control = self._control_file.read()

    # -- opening, deciding, closing --------------------------------------------------------------------

    def _trouble(self, verdicts: list[Verdict], mono: float) -> tuple[str, Verdict] | None:
        """A new incident, from verdicts that began after the last incident ended (the pass that proves an engine
        back may still carry the down or frozen verdict of the restart it ends)."""
        quiet = self._quiet_since

        def lasted(v: Verdict) -> float:
            return mono - (v.since if quiet is None else max(v.since, quiet))

        for v in verdicts:
            if v.state == State.FROZEN and (quiet is None or v.since > quiet
                                            or lasted(v) >= self.cfg.judge.stall_window):
                return "frozen", v
        for v in verdicts:
            if v.state == State.DOWN and lasted(v) >= self.r.down_after:
                return "down", v
            if v.state == State.STARTING and lasted(v) >= self.r.boot_timeout:
                return "boot_timeout", v
        return None

    def _open(self, kind: str, v: Verdict, now: float) -> None:
        reserved = self._reserved.pop(v.engine, None) if kind == "frozen" else None
        iid = reserved or incident_id(now, self.cfg.engine.name, v.engine, kind, secrets.token_hex(2))
        inc = Incident(iid, v.engine, kind, now, v.reason)
        down_bundle = self.bundle if kind == "down" and self.cfg.capture.enabled else None
        inc.phase = "evidence" if (kind == "frozen" and self.cfg.capture.enabled) or down_bundle else "open"
        self._evidence_wait_until = now + self.r.evidence_timeout
        self.memory.incident, self._said = inc, ""
        self._save()
        self._event(inc, "incident_opened", reason=v.reason)
        inc.in_hand = in_hand(self._ruling(inc, now, paused=False).choice)  # restarted within budget: no page
        if down_bundle is not None:  # its bundle (the log's cause) before any restart
            down_bundle(v.engine, iid, v.reason)
        said, rb = self._stacks_said.pop(v.engine, ("", ""))  # a freeze the stacks confirmed: their headline
        if not (said and said in v.reason):  # else by kind (down: a rank lost, or the API server)
            said, rb = v.reason, {"frozen": Runbook.FROZEN, "boot_timeout": Runbook.STARTING_TOO_LONG}.get(
                kind, down_runbook(v.reason))
        self._alert(inc, "engine_down" if kind == "down" else "stall_detected", said, {"kind": kind} if kind == "down"
                    else {"kind": kind, "stalled_for": round(v.stalled_for, 1)}, runbook=Runbook(rb))
        if inc.phase == "open":
            self._decide(inc, now)

    def _cleared(self, inc: Incident) -> bool:
        """Serving again by itself: progress or a successful generation (stacks alone do not count)."""
        v = self._verdicts.get(inc.engine)
        return v is not None and v.state in (State.WORKING, State.IDLE) and not v.stacks_only

    def _confirmed(self, inc: Incident) -> bool:
        """Still bad in this pass's verdicts: the last check before acting."""
        v = self._verdicts.get(inc.engine)
        if v is None:
            return inc.kind == "down"  # the engine's series are gone with the server
        if inc.attempts:  # a restart failed to bring it back by the boot timeout: still starting is still bad
            return v.state in (State.FROZEN, State.DOWN, State.STARTING)
        wanted = {"frozen": (State.FROZEN, State.DOWN), "down": (State.DOWN,), "boot_timeout": (State.STARTING,)}
        return v.state in wanted[inc.kind]

    def _ruling(self, inc: Incident, now: float, working: bool = False, paused: bool | None = None) -> Ruling:
        gave_up = self.memory.gave_up is not None and self.memory.gave_up.get("at", 0) >= self.control.reset_at
        return choose(inc.kind, budget=self.budget, restarts=self.memory.restarts, now=now,
                      reset_at=self.control.reset_at, stacks_working=working,
                      paused=self.control.is_paused(now) if paused is None else paused,
                      dry_run=self.r.dry_run, gave_up=gave_up, has_steps=bool(self.r.steps),
                      supervised=self.r.supervised, on_boot_timeout=self.r.on_boot_timeout)

    def _decide(self, inc: Incident, now: float) -> None:
        working = inc.evidence == "working"
        if working and inc.held_since is not None and now - inc.held_since >= self.r.hold_max:
            working = False
            if self._said != "held too long":
                self._said = "held too long"
                self._event(inc, "hold_ended", reason=f"held {now - inc.held_since:.0f}s without progress")
        d = self._ruling(inc, now, working)
        if d.choice != Choice.PAUSED:  # once out of hand (a human is needed) it pages; a pause only waits
            inc.in_hand = inc.in_hand and in_hand(d.choice)
        if d.choice == Choice.RESTART:
            self._restart(inc, now)
            return
        if d.choice == Choice.AWAIT_SUPERVISOR:
            inc.phase = "proving"
            self._save()
            self._event(inc, "awaiting_supervisor", reason=d.reason)
            self.recovery.start(RecoveryJob(inc.id, False, now + self.r.boot_timeout))
            return
        if d.choice == Choice.HOLD and inc.held_since is None:
            inc.held_since = now
        if d.choice == Choice.GIVE_UP and inc.phase == "gave_up":
            return
        if d.choice == Choice.GIVE_UP:
            inc.phase = "gave_up"
            self.memory.gave_up = {"at": now, "incident": inc.id, "reason": d.reason}
            self._save()
            self._event(inc, "gave_up", reason=d.reason)
            self._alert(inc, "gave_up", f"gave up, a human is needed: {d.reason}",
                        {"kind": inc.kind, "restarts_in_window": len(self.budget.recent(self.memory.restarts, now))},
                        runbook=Runbook.GAVE_UP)
            return
        said = f"{d.choice.value}: {d.reason.split(':')[0]}"
        if said != self._said:  # announce each decision once, not every pass
            self._said = said
            inc.phase = {Choice.HOLD: "held", Choice.WAIT: "waiting"}.get(d.choice, "observing")
            self._save()
            extra: dict[str, Any] = {"plan": self.plan} if d.choice == Choice.DRY_RUN else {}
            self._event(inc, f"restart_{'held' if d.choice == Choice.HOLD else 'not_run'}", choice=d.choice.value,
                        reason=d.reason, **extra)
            log.warning("incident %s: %s", inc.id, d.reason)

    def _restart(self, inc: Incident, now: float) -> None:
        inc.phase, inc.attempts, inc.restart_started = "restarting", inc.attempts + 1, now
        self.memory.restarts = [*self.budget.recent(self.memory.restarts, now), now]
        self._save()  # on disk before acting: a crash from here on resumes, never restarts twice
        left = self.budget.left(self.memory.restarts, now, self.control.reset_at)
        self._event(inc, "restart_started", attempt=inc.attempts, budget_left=left, plan=self.plan)
        self._alert(inc, "restart_started", f"restart {inc.attempts} issued ({left} left in the budget)",
                    {"kind": inc.kind, "attempt": inc.attempts, "budget_left": left})
        self.recovery.start(RecoveryJob(inc.id, True, now + self.r.boot_timeout))

    def _recovery_done(self, done: RecoveryDone, now: float) -> None:
        inc = self.memory.incident
        if inc is None or inc.id != done.job.incident:
            return
        if inc.phase == "restarting":  # the steps ended (or failed) between two passes: not said yet
            self._steps_event(inc, done.outcome)
        if done.ok:
            ready = done.ready_at or now
            downtime = round(ready - inc.detected, 1)
            self._event(inc, "recovered", downtime=downtime, detail=done.detail)
            self._alert(inc, "recovered", f"serving again after {downtime:.0f}s ({done.detail})",
                        {"kind": inc.kind, "downtime": downtime, "restart_took": round(done.steps_duration, 1),
                         "attempts": inc.attempts}, state="serving")
            self._resolve(inc, now, "recovered")
            return
        inc.phase, self._said, inc.in_hand = "open", "", False  # a failed restart pages
        self._save()
        self._event(inc, "restart_failed", stage=done.stage, error=done.detail, attempt=inc.attempts)
        self._alert(inc, "restart_failed", f"{done.stage}: {done.detail}", {"kind": inc.kind, "stage": done.stage,
                    "error": done.detail, "attempt": inc.attempts}, runbook=Runbook.RESTART_FAILED)

    def _steps_event(self, inc: Incident, outcome: RestartOutcome | None) -> None:
        """``restart_steps``: what ran, in order, on which node, and each node's /dev/shm check (names, bytes)."""
        if outcome is not None:
            self._event(inc, "restart_steps", ok=outcome.ok, seconds=round(outcome.duration, 1),
                        steps=list(outcome.steps), shm=[r.record() for r in outcome.shm])

    def _resolve(self, inc: Incident, now: float, how: str) -> None:
        self.memory.incident, self._quiet_since = None, self._mono
        self._save()
        self._event(inc, "resolved", how=how, lasted=round(now - inc.detected, 1))
        self._alert(inc, "resolved", how, {"kind": inc.kind, "lasted": round(now - inc.detected, 1)}, resolved=True)

    # -- output ----------------------------------------------------------------------------------------

    def _save(self) -> None:
        try:
            save_memory(self.state_dir, self.memory)
        except OSError as e:
            log.error("cannot write the recovery state to %s: %s (a restarted watchdog will not know it)",
                      self.state_dir, e.strerror)

    def _event(self, inc: Incident, name: str, **fields: object) -> None:
        self.event({"event": name, "incident": inc.id, "engine": inc.engine, "kind": inc.kind, **fields})

    def _alert(self, inc: Incident, event: str, summary: str, details: dict[str, Any],
               resolved: bool = False, state: str | None = None, runbook: Runbook | None = None) -> None:
        if self.control.is_paused(self.wall()):
            self._event(inc, "alert_suppressed", alert=event, why="paused")
            return
        if state is None:
            v = self._verdicts.get(inc.engine)
            state = "serving" if resolved else inc.phase if inc.phase in ACTIVE else v.state.value if v else "unknown"
        self.alerts.submit(Alert(event, inc.id, inc.engine, self.cfg.engine.name, base_url(self.cfg.engine.url),
                                 state, summary, details, self.wall(), resolved,
                                 "" if runbook is None else runbook_link(runbook, self.cfg.alerts.runbook_base),
                                 "warning" if inc.in_hand else "critical"))

    def status(self, now: float) -> dict[str, Any]:
        inc, progress = self.memory.incident, self.recovery.progress
        until = self.control.paused_until
        return {
            "incident": None if inc is None else {"id": inc.id, "engine": inc.engine, "kind": inc.kind,
                                                  "phase": inc.phase, "attempts": inc.attempts, "bundle": inc.bundle,
                                                  "in_hand": inc.in_hand},
            "recovery": None if progress is None else {"phase": progress.phase,
                                                       "seconds": round(now - progress.since, 1),
                                                       "since": progress.since,
                                                       "tries": progress.tries, "last_try": progress.last_try},
            "paused": self.control.is_paused(now), "paused_until": until, "pause_reason": self.control.reason,
            "budget_left": self.budget.left(self.memory.restarts, now, self.control.reset_at),
            "budget": self.r.budget, "gave_up": self.memory.gave_up, "dry_run": self.r.dry_run,
            "restart_configured": bool(self.r.steps),
        }
