"""The evidence round trip, owned in one place: which verdicts ask for stacks, and where a finished capture goes.

- a suspicion (and a long step due for another look) asks for a check: two captures, a decision fed back to the
  judge as `StackEvidence`;
- an incident asks for its bundle when it opens (`bundle`), named with its id (the one id of bundle, events,
  alerts and status): a freeze's stacks (the capture that decided the suspicion serves when it is recent enough),
  or a down engine's log cause and what is left running;
- every finished job becomes one event (``evidence_checked``, ``evidence_captured`` or ``evidence_failed``) and,
  for the engine's incident, what the stacks said.

No I/O of its own: the runner (`watchdog.evidence.bundle.investigate.EvidenceRunner`) captures in its thread; this class
only books what was asked and hands on what came back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from watchdog.core.types import Decision, StackEvidence, State, Transition
from watchdog.evidence.bundle.investigate import EvidenceDone, EvidenceJob
from watchdog.evidence.explain.headline import compose
from watchdog.evidence.explain.known_hangs import match as match_known
from watchdog.evidence.explain.known_hangs import with_clause
from watchdog.evidence.explain.log_cause import down_runbook


class Runner(Protocol):
    def request(self, job: EvidenceJob) -> None: ...
    def poll(self) -> list[EvidenceDone]: ...


@dataclass(frozen=True, slots=True)
class ForIncident:
    """What the stacks said, for the engine's incident. ``final``: the freeze's own bundle (or its failure)."""

    engine: str
    decision: Decision | None  # None: no stacks could be taken
    bundle: str | None
    details: dict[str, Any]
    final: bool
    incident: str = ""  # the incident the bundle was written for ("" for a check)


@dataclass(frozen=True, slots=True)
class Outcome:
    event: dict[str, Any]  # without time and stack: the daemon stamps those
    observation: StackEvidence | None  # for the judge: only checks of a suspicion or of a long step
    incident: ForIncident | None


@dataclass
class EvidenceCoordinator:
    runner: Runner
    stall_window: float  # a freeze's bundle may reuse a capture taken this long before it
    _checking: set[str] = field(default_factory=set)  # engines with a check in flight

    def on_transition(self, tr: Transition, now: float) -> None:
        """A suspicion asks for a check; leaving suspect or frozen ends the one in flight's claim."""
        if tr.to_state == State.SUSPECT:
            self.check(tr.engine, tr.reason, now)
        elif tr.to_state != State.FROZEN:
            self._checking.discard(tr.engine)

    def bundle(self, engine: str, state: State, incident: str, reason: str, now: float,
               stalled_since: float | None = None) -> None:
        """An incident's bundle. A freeze's: the capture that confirmed (or was taken during) its suspicion serves
        (``stalled_since``: wall time of the last progress the judge saw; its GPU readings start there). A down
        engine's: the log's cause, what is left running, the GPUs (never a capture of before)."""
        reuse_after = now - self.stall_window if state == State.FROZEN else float("inf")
        self.runner.request(EvidenceJob(engine, state.value, reason, True, reuse_after, incident, stalled_since))

    def check(self, engine: str, reason: str, now: float) -> None:
        """Ask for a check of the stacks (one in flight per engine)."""
        if engine not in self._checking:
            self._checking.add(engine)
            self.runner.request(EvidenceJob(engine, State.SUSPECT.value, reason, False, now))

    def collect(self, now: float) -> list[Outcome]:
        return [self._outcome(done, now) for done in self.runner.poll()]

    def _outcome(self, done: EvidenceDone, now: float) -> Outcome:
        job, engine = done.job, done.job.engine
        if not job.bundle:
            self._checking.discard(engine)
        ids: dict[str, Any] = {"incident": job.incident} if job.incident else {}
        if done.evidence is None:
            event: dict[str, Any] = {"event": "evidence_failed", "engine": engine, "error": done.error, **ids}
            return Outcome(event, None, ForIncident(engine, None, None, {"error": done.error}, True, job.incident)
                           if job.bundle else None)
        f = done.evidence.findings
        # what happened, from the cause down, and its runbook: the bundle's (with its GPU evidence) when written
        said = compose(f, done.evidence.capture)
        known = match_known(f, done.evidence.capture, vllm=done.evidence.vllm)  # no log here: the stacks and rings
        headline, runbook = done.said if done.said[0] else (with_clause(said.text, known), said.runbook.value)
        if job.state == State.DOWN.value and not done.said[0]:  # no bundle to read its log's cause from
            headline, runbook = f"down: {job.reason}", down_runbook(job.reason).value
        summary: dict[str, Any] = {"decision": f.decision.value, "headline": headline, "runbook": runbook,
                                   "reason": f.reason, "culprit": f.cross_rank.culprit,
                                   "poll_parking": f.hypothesis.status.value, "complete": f.complete,
                                   "capture_problems": list(f.problems),
                                   "stuck_kind": f.stuck_kind.value if f.stuck_kind else None}
        details = {k: v for k, v in summary.items() if k != "decision"}
        if done.error:
            details["error"] = done.error
        bundle = str(done.bundle) if done.bundle else None
        if not job.bundle:
            # a freeze the stacks confirm is said by its headline (the verdict's reason: its event, log and alert)
            reason = headline if f.decision is Decision.STUCK else f.reason
            obs = StackEvidence(now, engine, f.decision, reason, captured_at=done.started)
            return Outcome({"event": "evidence_checked", "engine": engine, **summary,
                            "capture_seconds": round(done.evidence.seconds, 3)}, obs,
                           ForIncident(engine, f.decision, None, details, False))
        event = {"event": "evidence_captured", "engine": engine, "bundle": bundle, "error": done.error or None,
                 **ids, **summary, "capture_seconds": round(done.evidence.seconds, 3)}
        return Outcome(event, None, ForIncident(engine, f.decision, bundle, details, True, job.incident))
