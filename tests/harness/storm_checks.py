"""What the storm checks after every fault and at its end, over what the watchdog left on disk and what the receiver
got: plain functions of data, each returning the problems it found (an empty list: all is well).

- `incident_problems`: each incident opened once, closed at most once, nothing said of it after it closed, never a
  second restart while one runs (a new restart only after the last one failed);
- `alert_problems`: every alert the ledger says was delivered reached the receiver, none reached it that the ledger
  does not hold, none twice unless the ledger shows it queued again by a watchdog that was killed before it could
  write the outcome (a receiver dedupes those by their ``id``), and in order per incident;
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


def generations(state_dir: Path, name: str) -> list[Path]:
    return [state_dir / f"{name}.1", state_dir / name]


def incident_problems(events: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    by_incident: dict[str, list[str]] = defaultdict(list)
    for e in events:
        inc = e.get("incident")
        if isinstance(inc, str) and e.get("event") != "transition":
            by_incident[inc].append(str(e.get("event")))
    for inc, names in by_incident.items():
        counts = Counter(names)
        if counts["incident_opened"] != 1:
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


def _key(body: Mapping[str, Any]) -> str:
    return str(body.get("id") or f"{body.get('incident_id')}/{body.get('event')}")


def alert_problems(ledger: list[dict[str, Any]], received: list[Mapping[str, Any]], sink: str) -> list[str]:
    """``ledger``: the records of ``alerts.jsonl`` (both generations); ``received``: the webhook bodies in arrival
    order; ``sink``: the receiver's sink name in the watchdog's config."""
    problems: list[str] = []
    mine = [r for r in ledger if r.get("sink") == sink]
    queued = Counter(str(r.get("key")) for r in mine if r.get("record") == "queued")
    outcome = {str(r.get("key")): str(r.get("record")) for r in mine if r.get("record") in ("delivered", "failed")}
    ids = {str(r.get("key")): _body_id(r) for r in mine if r.get("record") == "queued"}
    got = Counter(_key(b) for b in received)
    for key, rec in outcome.items():
        n = got[ids.get(key, key)]
        if rec == "delivered" and n == 0:
            problems.append(f"alert {key}: the ledger says delivered, the receiver never got it")
    known = set(ids.values())
    for key, n in got.items():
        if key not in known:
            problems.append(f"alert {key}: received {n} times, not in the ledger")
        elif n > 1:
            ledger_key = next(k for k, v in ids.items() if v == key)
            if n > queued[ledger_key]:
                problems.append(f"alert {key}: received {n} times, queued {queued[ledger_key]} times")
    order: dict[str, list[str]] = defaultdict(list)
    for r in mine:
        if r.get("record") == "queued" and outcome.get(str(r.get("key"))) == "delivered":
            ev = str(r.get("event"))
            if ev not in order[str(r.get("incident"))]:
                order[str(r.get("incident"))].append(ev)
    seen: dict[str, list[str]] = defaultdict(list)
    for b in received:
        ev = str(b.get("event"))
        if ev not in seen[str(b.get("incident_id"))]:
            seen[str(b.get("incident_id"))].append(ev)
    for inc, evs in order.items():
        if seen.get(inc, []) != evs and set(seen.get(inc, [])) == set(evs):
            problems.append(f"incident {inc}: alerts arrived as {seen[inc]}, queued as {evs}")
    return problems


def _body_id(record: Mapping[str, Any]) -> str:
    alert = record.get("alert")
    if isinstance(alert, Mapping) and alert.get("id"):
        return str(alert["id"])
    return str(record.get("id") or f"{record.get('incident')}/{record.get('event')}")


def duplicates(received: list[Mapping[str, Any]]) -> int:
    """Deliveries of an id the receiver already had (the at-least-once window of a killed watchdog)."""
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


def tree_bytes(root: Path) -> int:
    total = 0
    for p in root.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
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
