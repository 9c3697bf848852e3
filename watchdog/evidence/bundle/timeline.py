"""An incident's timeline and its stall, from the event log and the page trace around a bundle. Pure: records in,
rows and numbers out (times are the records' own).

- ``timeline``: the engine's transitions, stack checks and the incident's own events (opened, captured, restart,
  recovered, resolved), from the first suspicion of this stall to the incident's last event;
- ``stall``: how long the page showed no progress when the stacks were taken: from the trace's scrapes when the
  state directory has them (the last scrape whose token counters moved), else estimated from the first suspicion
  and ``suspect_after``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

from watchdog.evidence.bundle.redact import one_line

MAX_ROWS = 40


def wall_of(stamp: object) -> float | None:
    """An ISO-8601 time from a manifest or an event (``...Z`` or ``+00:00``) as seconds; None when unreadable."""
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def hms(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S.%f")[:-5]


@dataclass(frozen=True, slots=True)
class Row:
    wall: float
    what: str


@dataclass(frozen=True, slots=True)
class Stall:
    seconds: float | None  # no progress on the page when the stacks were taken
    source: str  # how it is known
    running: float | None = None
    waiting: float | None = None
    kv: float | None = None  # 0..1


def _t(ev: dict[str, Any]) -> float | None:
    return wall_of(ev.get("time"))


def _is(ev: dict[str, Any], name: str, to: str | None = None) -> bool:
    return ev.get("event") == name and (to is None or ev.get("to") == to)


def _stacks_only(evs: Sequence[dict[str, Any]], i: int) -> bool:
    """A transition to working that a stack check made (the page had not moved): the stall went on."""
    t = _t(evs[i])
    return t is not None and any(_is(e, "evidence_checked") and e.get("decision") == "working"
                                 and (u := _t(e)) is not None and abs(u - t) <= 1.0 for e in evs)


def _first_suspicion(evs: Sequence[dict[str, Any]], verdict: int) -> int:
    """Index of the first transition of the stall that ends in ``evs[verdict]``."""
    start = verdict
    for i in range(verdict - 1, -1, -1):
        e = evs[i]
        if not _is(e, "transition"):
            continue
        if e.get("to") == "suspect":
            start = i
        elif not (e.get("to") == "working" and _stacks_only(evs, i)):
            break
    return start


def _engine_events(events: Sequence[dict[str, Any]], engine: str | None, incident: str) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and _t(e) is not None
            and (e.get("incident") == incident or engine is None or str(e.get("engine")) == engine)]


def _verdict_index(evs: Sequence[dict[str, Any]], incident: str, created: float | None) -> int | None:
    """The transition that opened the incident: the last to frozen/down at or before its first event (or the
    bundle's creation, for a dump on demand)."""
    mine = [_t(e) for e in evs if e.get("incident") == incident]
    until = (mine[0] if mine else created)
    if until is None:
        return None
    found = None
    for i, e in enumerate(evs):
        t = _t(e)
        if t is not None and t <= until + 2.0 and _is(e, "transition") and e.get("to") in ("frozen", "down"):
            found = i
    return found


def _say(e: dict[str, Any]) -> str:
    name = str(e.get("event"))
    if name == "transition":
        return f"{e.get('from') or 'start'} -> **{e.get('to')}**: {e.get('reason', '')}"
    if name == "evidence_checked":
        culprit = f", culprit {e['culprit']}" if e.get("culprit") else ""
        return f"stacks checked: {e.get('decision')}{culprit}: {e.get('reason', '')}"
    if name == "evidence_captured":
        culprit = f", culprit {e['culprit']}" if e.get("culprit") else ""
        return f"stacks captured, bundle written: {e.get('decision')}{culprit}"
    said = {"evidence_failed": "stack capture failed", "incident_opened": "incident opened",
            "restart_started": f"restart started (attempt {e.get('attempt')})",
            "restart_steps": f"restart steps {'done' if e.get('ok') else 'FAILED'} in {e.get('seconds')} s",
            "restart_failed": f"restart FAILED at {e.get('stage')}",
            "recovered": f"**recovered**: serving again {e.get('downtime')} s after detection",
            "resolved": f"resolved: {e.get('how', '')}", "gave_up": "gave up (no more restarts)"}
    return said.get(name, name.replace("_", " ") + (f": {e['reason']}" if isinstance(e.get("reason"), str) else ""))


def timeline(events: Sequence[dict[str, Any]], engine: str | None, incident: str,
             created: float | None) -> list[Row]:
    """The rows of this incident, oldest first (free text not yet scrubbed: the caller does)."""
    evs = _engine_events(events, engine, incident)
    v = _verdict_index(evs, incident, created)
    start_t = _t(evs[_first_suspicion(evs, v)]) if v is not None else created
    mine = [t for e in evs if e.get("incident") == incident and (t := _t(e)) is not None]
    end_t = max(mine) if mine else (created if created is not None else start_t)
    if start_t is None or end_t is None:
        return []
    rows = [Row(t, one_line(_say(e), 240)) for e in evs if (t := _t(e)) is not None and start_t <= t <= end_t
            and (e.get("incident") == incident or e.get("event") in ("transition", "evidence_checked"))]
    return rows[:MAX_ROWS]


def suspected_at(events: Sequence[dict[str, Any]], engine: str | None, incident: str,
                 created: float | None) -> float | None:
    evs = _engine_events(events, engine, incident)
    v = _verdict_index(evs, incident, created)
    if v is None:
        return None
    first = evs[_first_suspicion(evs, v)]
    return _t(first) if first.get("to") == "suspect" else None


def _counters(reading: dict[str, Any]) -> dict[str, float]:
    raw = reading.get("counters")
    return {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float)} if isinstance(raw, dict) else {}


def stall(scrapes: Sequence[dict[str, Any]], engine: str | None, created: float | None, suspect_t: float | None,
          suspect_after: float | None) -> Stall:
    """How long nothing moved on the page before the capture (see the module's doc)."""
    seen: list[tuple[float, dict[str, Any]]] = []
    for s in scrapes:
        engines = s.get("engines") if isinstance(s, dict) else None
        wall = s.get("wall") if isinstance(s, dict) else None
        if not isinstance(engines, dict) or not isinstance(wall, int | float) or created is None or wall > created:
            continue
        e = engines.get(engine) if engine in engines else next(iter(engines.values()), None) if len(engines) == 1 \
            else None
        if isinstance(e, dict):
            seen.append((float(wall), e))
    if seen:
        seen.sort(key=lambda x: x[0])
        last = seen[-1][1]
        moved = None
        for (_, a), (t, b) in pairwise(seen):
            ca, cb = _counters(a), _counters(b)
            if any(v > ca.get(k, 0.0) for k, v in cb.items()):
                moved = t
        nums = [last.get(k) if isinstance(last.get(k), int | float) else None for k in ("running", "waiting", "kv")]
        if moved is not None and created is not None:
            return Stall(round(created - moved, 1), "the watchdog's page trace: the last scrape whose token "
                         "counters moved", *nums)
        if created is not None and len(seen) > 1:
            return Stall(None, f"the page trace holds no progress in its last {created - seen[0][0]:.0f} s",
                         *nums)
    if suspect_t is not None and created is not None and suspect_after is not None:
        return Stall(round(created - suspect_t + suspect_after, 1),
                     f"estimated: first suspicion at {hms(suspect_t)} UTC plus suspect_after {suspect_after:g} s")
    return Stall(None, "not known (no page trace and no suspicion in the event log)")
