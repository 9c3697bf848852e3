"""The watchdog's own probes decided: ``/readyz`` and ``/livez`` for load balancers and the kubelet. Pure: the last
pass's verdicts with their clock, since when each engine has been in trouble, the open incident and the watchdog's
own health in; a status code and a short JSON-able body out. Times come in as data (the exporter reads the clock).

- **ready** (``/readyz``, ``?engine=ID`` for one engine): 200 while every engine asked about is idle, working or
  suspect (a suspicion is not yet a freeze: the stacks may still explain a long step, and taking a busy engine out on
  a 5 s silence would drain it for nothing); 503 for starting (no generation has proven it serves yet: readiness is
  a generation, never an open port), frozen, down and blind (the watchdog cannot see it: it never vouches for what it
  cannot see), and before the first verdict; and while the engine's incident is restarting it or waiting for the
  first generation after (``restarting``, ``proving``): an engine whose metrics answer again is not yet proven to
  serve, so it comes back into rotation only once the watchdog has said ``recovered``;
- **live** (``/livez``): 503 only when an engine has been frozen or down, without a break between the two, for
  longer than ``exporter.live_after``: the kubelet's restart is the last resort, after the watchdog's own evidence
  capture and restart had their chance; starting, blind and suspect never fail it;
- **the watchdog's own health**: no pass finished for ``stale_after`` seconds (its loop is stuck: its verdicts say
  nothing about now) fails both; its state directory cannot be used (events, incidents and the restart record would
  be lost) fails ``/readyz`` only: recreating the pod does not give a full disk room, and ``/livez`` may be wired to
  the engine's container, so a full volume must not restart a healthy engine group again and again.

The body: ``ready``/``live``, then the engine that decided (the first one not ready, or the first one asked about):
``engine``, ``state``, ``reason`` (cut to a few hundred characters), ``for_seconds``, ``incident`` (the open
incident's id when it is this engine's), ``watchdog`` ("ok" or what is wrong with it), and ``engines`` (every
engine's state) when several are watched and none was named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from watchdog.core.types import State, Verdict

READY = frozenset({State.IDLE, State.WORKING, State.SUSPECT})
TROUBLE = frozenset({State.FROZEN, State.DOWN})  # what counts towards /livez
REASON_MAX = 300
RECOVERING = frozenset({"restarting", "proving"})  # incident phases in which the engine is not yet proven back


class OpenIncident(NamedTuple):
    """The open incident as the probes see it (from the act stage's status)."""

    engine: str
    id: str
    phase: str = "open"


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    live_after: float = 300.0  # seconds frozen or down before /livez fails (exporter.live_after)
    stale_after: float = 30.0  # seconds without a finished pass before the watchdog calls itself stuck


def stale_after(interval: float, scrape_deadline: float) -> float:
    """How long a pass may take before the loop counts as stuck: a pass is bounded by its scrape's deadline (the rest
    runs in threads of its own), so three of the slowest passes, and never under 30 s."""
    return max(30.0, 3.0 * (interval + scrape_deadline))


@dataclass(frozen=True, slots=True)
class Answer:
    code: int
    body: dict[str, object] = field(default_factory=dict)


def carry_trouble(before: Mapping[str, float], verdicts: Sequence[Verdict]) -> dict[str, float]:
    """Since when each engine has been frozen or down without a break (the verdicts' clock): a freeze that vLLM's own
    timeout turns into ``down`` is one stretch of trouble, not two short ones. Engines in any other state are left
    out. Called whenever a state changes; the result is the next call's ``before``."""
    return {v.engine: before.get(v.engine, v.since) for v in verdicts if v.state in TROUBLE}


def probe_problems(last_pass_age: float | None, up_for: float, settings: ProbeSettings,
                   state_problem: str = "") -> tuple[str, str]:
    """(what fails ``/readyz``, what fails ``/livez``) of the watchdog's own health: a stuck loop fails both, a state
    directory that cannot be used fails readiness only."""
    stuck = own_problem(last_pass_age, up_for, settings)
    return own_problem(last_pass_age, up_for, settings, state_problem), stuck


def own_problem(last_pass_age: float | None, up_for: float, settings: ProbeSettings, state_problem: str = "") -> str:
    """What is wrong with the watchdog itself, or "". ``last_pass_age``: seconds since the last pass handed its
    verdicts over (None: none yet); ``up_for``: seconds since the service started."""
    if state_problem:
        return f"the watchdog's state directory cannot be used: {state_problem}"
    if last_pass_age is None:
        if up_for > settings.stale_after:
            return f"the watchdog has finished no pass in the {up_for:.0f}s since it started"
        return ""
    if last_pass_age > settings.stale_after:
        return f"the watchdog's loop has finished no pass for {last_pass_age:.0f}s"
    return ""


def readiness(verdicts: Sequence[Verdict], now: float, incident: OpenIncident | None, problem: str,
              engine: str | None = None) -> Answer:
    """``/readyz``: ``now`` is the verdicts' clock at the moment asked; ``incident`` the open one, if any."""
    chosen = _chosen(verdicts, engine)
    if isinstance(chosen, Answer):
        return _with(chosen, "ready", problem)
    if problem:
        return _body(503, "ready", False, chosen[0], now, incident, problem, verdicts, engine)
    bad = next((v for v in chosen if v.state not in READY), None)
    if bad is not None:
        return _body(503, "ready", False, bad, now, incident, problem, verdicts, engine)
    back = next((v for v in chosen if incident is not None and incident.phase in RECOVERING
                 and incident.engine == v.engine), None)
    if back is not None and incident is not None:
        answer = _body(503, "ready", False, back, now, incident, problem, verdicts, engine)
        answer.body["reason"] = (f"the watchdog is {incident.phase} it (incident {incident.id}): ready again after "
                                 "its first generation")[:REASON_MAX]
        answer.body["recovery"] = incident.phase
        return answer
    return _body(200, "ready", True, chosen[0], now, incident, problem, verdicts, engine)


def liveness(verdicts: Sequence[Verdict], now: float, trouble_since: Mapping[str, float],
             incident: OpenIncident | None, problem: str, live_after: float, engine: str | None = None) -> Answer:
    """``/livez``: fails on ``problem`` (the watchdog's stuck loop: `probe_problems`' second; never its state
    directory), or an engine frozen or down longer than ``live_after``."""
    chosen = _chosen(verdicts, engine)
    if isinstance(chosen, Answer):  # nothing known yet: alive unless the watchdog itself is not
        return _with(chosen if chosen.code == 404 else Answer(200, chosen.body), "live", problem)
    if problem:
        return _body(503, "live", False, chosen[0], now, incident, problem, verdicts, engine)
    worst = max(chosen, key=lambda v: now - trouble_since.get(v.engine, now))
    began = trouble_since.get(worst.engine)
    if began is not None and now - began > live_after:
        answer = _body(503, "live", False, worst, now, incident, problem, verdicts, engine, began)
        answer.body["live_after"] = live_after
        return answer
    return _body(200, "live", True, worst, now, incident, problem, verdicts, engine, began)


def _chosen(verdicts: Sequence[Verdict], engine: str | None) -> list[Verdict] | Answer:
    if not verdicts:
        return Answer(503, {"engine": engine, "state": None, "reason": "no verdict yet", "for_seconds": 0.0,
                            "incident": None})
    if engine is None:
        return list(verdicts)
    mine = [v for v in verdicts if v.engine == engine]
    if not mine:
        return Answer(404, {"engine": engine, "state": None, "reason": f"no engine {engine!r} is watched here",
                            "engines": sorted(v.engine for v in verdicts)})
    return mine


def _with(answer: Answer, key: str, problem: str) -> Answer:
    code = 503 if problem and answer.code != 404 else answer.code
    return Answer(code, {key: code == 200, **answer.body, "watchdog": problem or "ok"})


def _body(code: int, key: str, good: bool, v: Verdict, now: float, incident: OpenIncident | None, problem: str,
          verdicts: Sequence[Verdict], engine: str | None, began: float | None = None) -> Answer:
    reason = v.reason if len(v.reason) <= REASON_MAX else v.reason[: REASON_MAX - 3] + "..."
    body: dict[str, object] = {
        key: good, "engine": v.engine, "state": v.state.value, "reason": reason,
        "for_seconds": round(max(0.0, now - (v.since if began is None else began)), 1),
        "incident": incident.id if incident is not None and incident.engine == v.engine else None,
        "watchdog": problem or "ok",
    }
    if engine is None and len(verdicts) > 1:
        body["engines"] = {x.engine: x.state.value for x in verdicts}
    return Answer(code, body)
