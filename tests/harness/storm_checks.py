"""What the storm checks after every fault and at its end, over what the watchdog left on disk and what the receiver
got: plain functions of data, each returning the problems it found (an empty list: all is well).

- `incident_problems`: each incident opened once (or before the oldest generation of the rolled-over log kept),
  closed at most once, nothing said of it after it closed, never a
  second restart while one runs (a new restart only after the last one failed);
- `alert_problems`: every alert reached the receiver at most once, in its incident's order, and an incident that
  opened and closed while the receiver was up and the watchdog alive had its opening and its resolution delivered;
- `ledger_problems`: the delivery log agrees with the receiver (delivered means received, failed means not);
- `state_problems`: ``status.json`` and ``recovery.json`` parse and agree with each other and with the event log;
- `disk_problems`: the state directory within its configured bounds.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CLOSING = ("resolved",)


def read_jsonl(paths: Iterable[Path]) -> tuple[list[dict[str, Any]], int]:
    """Every record of these files in order, and how many lines did not parse (a torn last line of a killed
    writer is one; more than one per file is a problem the caller reports)."""
    out: list[dict[str, Any]] = []
    bad = 0
    for p in paths:
        try:
            text = p.read_text(errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(rec, dict):
                out.append(rec)
            else:
                bad += 1
    return out, bad


def incident_problems(events: list[dict[str, Any]], full: Iterable[tuple[float, float]] = ()) -> list[str]:
    """``full``: the (from, to) wall times the state directory was full: an incident opened then may lack the events
    that could not be written (the watchdog counts and alerts them), never have them twice."""
    problems: list[str] = []
    first: dict[str, float] = {}
    by_incident: dict[str, list[str]] = defaultdict(list)
    horizon: set[str] = set()  # incidents with records before the log's first opening: opened before what is kept
    seen_opening = False
    for e in events:
        inc = e.get("incident")
        if isinstance(inc, str) and e.get("event") != "transition":
            by_incident[inc].append(str(e.get("event")))
            first.setdefault(inc, _when(e))
            seen_opening = seen_opening or e.get("event") == "incident_opened"
            if not seen_opening:
                horizon.add(inc)
    windows = list(full)
    for inc, names in by_incident.items():
        counts = Counter(names)
        lossy = inc in horizon or any(a <= first[inc] <= b + 5 for a, b in windows)
        if counts["incident_opened"] > 1 or (counts["incident_opened"] == 0 and not lossy):
            problems.append(f"incident {inc}: opened {counts['incident_opened']} times ({names})")
        closes = sum(counts[c] for c in CLOSING)
        if closes > 1:
            problems.append(f"incident {inc}: closed {closes} times ({names})")
        if closes and names.index(CLOSING[0]) != len(names) - 1:
            after = names[names.index(CLOSING[0]) + 1:]
            problems.append(f"incident {inc}: events after it was resolved: {after}")
        running = 0
        for n in names:
            if n == "restart_started":
                if running:
                    problems.append(f"incident {inc}: a second restart while one ran ({names})")
                running = 1
            elif n in ("restart_failed", "recovered"):
                running = 0
    return problems


def _when(e: Mapping[str, Any]) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(e.get("time")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _key(body: Mapping[str, Any]) -> str:
    return f"{body.get('incident_id')}/{body.get('event')}"


# where each alert stands in an incident's life: what reaches a receiver must keep this order
RANK = {"stall_detected": 0, "engine_down": 0, "blind": 0, "blind_frozen": 1, "evidence_captured": 1,
        "restart_started": 2, "restart_failed": 3, "recovered": 4, "gave_up": 4, "resolved": 5}
OPENING = ("stall_detected", "engine_down", "blind")


def alert_problems(received: list[Mapping[str, Any]], events: list[dict[str, Any]],
                   quiet: Iterable[tuple[float, float]] = ()) -> list[str]:
    """``received``: the webhook bodies in arrival order; ``events``: the event log; ``quiet``: the (from, to) wall
    times the receiver was down or the watchdog was killed (an alert due then may be retried late or given up on).
    Every alert arrives at most once, in its incident's order; an incident whose life the receiver saw whole had its
    opening and its resolution delivered."""
    problems: list[str] = []
    got = Counter(_key(b) for b in received)
    problems += [f"alert {k}: received {n} times" for k, n in got.items() if n > 1]
    per: dict[str, list[str]] = defaultdict(list)
    for b in received:
        per[str(b.get("incident_id"))].append(str(b.get("event")))
    for inc, evs in per.items():
        ranks = [RANK.get(e, 9) for e in evs]
        if ranks != sorted(ranks):
            problems.append(f"incident {inc}: alerts arrived as {evs}")
    windows = list(quiet)
    life: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("event") in ("incident_opened", "resolved") and isinstance(e.get("incident"), str):
            life[e["incident"]].append(_when(e))
    for inc, (*times,) in life.items():
        if len(times) != 2 or any(a - 5 <= t <= b + 5 for a, b in windows for t in times) or \
                any(times[0] <= a <= times[1] for a, _b in windows):
            continue
        evs = per.get(inc, [])
        if not any(e in OPENING for e in evs) or "resolved" not in evs:
            problems.append(f"incident {inc}: opened and resolved while all was well, the receiver got {evs}")
    return problems


def ledger_problems(received: list[Mapping[str, Any]], ledger: list[dict[str, Any]], sink: str,
                    kills: int, full: Iterable[tuple[float, float]] = ()) -> list[str]:
    """The delivery log (``alerts.jsonl``) against the receiver: an alert logged delivered reached it, one logged
    failed did not, and everything it got is logged, save one per SIGKILL (killed between the answer and the line)
    and those delivered while the state directory was ``full`` (from, to wall times: the line could not be
    written)."""
    windows = list(full)
    lossy = {_key(b) for b in received if any(a <= _when(b) <= z + 5 for a, z in windows)}
    got = Counter(_key(b) for b in received)
    outcome: dict[str, str] = {}
    for r in ledger:
        if r.get("sink") == sink:
            outcome[f"{r.get('incident')}/{r.get('event')}"] = str(r.get("outcome"))
    problems = [f"alert {k}: logged delivered, never received" for k, o in outcome.items()
                if o == "delivered" and not got[k]]
    problems += [f"alert {k}: logged failed, yet received" for k, o in outcome.items() if o == "failed" and got[k]]
    unlogged = [k for k in got if k not in outcome and k not in lossy]
    if len(unlogged) > kills:
        problems.append(f"{len(unlogged)} alerts received that the delivery log does not have: {unlogged[:5]}")
    return problems


def duplicates(received: list[Mapping[str, Any]]) -> int:
    return sum(n - 1 for n in Counter(_key(b) for b in received).values() if n > 1)


def state_problems(state_dir: Path, events: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    docs: dict[str, Any] = {}
    for name in ("status.json", "recovery.json"):
        p = state_dir / name
        if not p.exists():
            continue
        try:
            docs[name] = json.loads(p.read_text())
        except ValueError as e:
            problems.append(f"{name} does not parse: {e}")
    opened = [e for e in events if e.get("event") == "incident_opened" and e.get("kind") != "blind"]
    closed = {e.get("incident") for e in events if e.get("event") in CLOSING}
    open_ids = [str(e["incident"]) for e in opened if e.get("incident") not in closed]
    rec = docs.get("recovery.json")
    held = _incident_id(rec.get("incident")) if isinstance(rec, dict) else None
    if held is not None and held not in open_ids:
        problems.append(f"recovery.json holds incident {held}, the events have it closed or never opened")
    if len(open_ids) > 1:
        problems.append(f"the events leave {len(open_ids)} incidents open: {open_ids}")
    if open_ids and isinstance(rec, dict) and held is None:
        problems.append(f"the events leave incident {open_ids[0]} open, recovery.json holds none")
    status = docs.get("status.json")
    if isinstance(status, dict) and held is not None:
        shown = _incident_id(status.get("incident"))
        if shown not in (None, held):
            problems.append(f"status.json shows incident {shown}, recovery.json holds {held}")
    return problems


def _incident_id(value: Any) -> str | None:
    if isinstance(value, dict):
        v = value.get("id")
        return str(v) if v else None
    return str(value) if value else None


def tree_bytes(root: Path, skip: tuple[str, ...] = ()) -> int:
    """The bytes of the files under ``root``, but those named in ``skip``."""
    total = 0
    for p in root.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink() and p.name not in skip:
                total += p.stat().st_size
        except OSError:
            continue
    return total


def disk_problems(state_dir: Path, bound: int, incidents_max: int, incidents_bytes: int) -> list[str]:
    problems: list[str] = []
    used = tree_bytes(state_dir)
    if used > bound:
        problems.append(f"the state directory holds {used} bytes, over its bound of {bound}")
    inc = state_dir / "incidents"
    if inc.is_dir():
        bundles = [p for p in inc.iterdir() if p.is_dir()]
        if len(bundles) > incidents_max:
            problems.append(f"{len(bundles)} incident bundles kept, incidents.max_count is {incidents_max}")
        if (b := tree_bytes(inc)) > incidents_bytes:
            problems.append(f"incident bundles hold {b} bytes, incidents.max_bytes is {incidents_bytes}")
    return problems
