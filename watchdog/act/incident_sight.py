"""Blind incidents in the incident machine: one per thing not seen, beside the engine's incident. Pure.

Each pass of sight (`Sighted`: this node's own verdicts, no overlay, and the other nodes' views) is ruled by
`watchdog.act.blind.rule`. The page or a node unseen for ``[alerts] blind_after`` s opens a ``blind`` incident
with an id of its own, alerted ``blind`` with the runbook of what cannot be seen; a stall here while a node cannot
be seen is said (in that alert, or later as ``blind_frozen``); seen again, it is ``resolved``. Nothing here
restarts anything. The incidents are kept in the memory, so a restarted watchdog still resolves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from watchdog.act import blind
from watchdog.act.incident_draft import Draft
from watchdog.act.incident_types import Incident, Kind, Phase, Say, Sighted
from watchdog.core.runbooks import Runbook
from watchdog.core.types import Verdict, iso


def name(inc: Incident) -> str:
    return blind.name_of(inc.unseen)


def sighted(d: Draft, ev: Sighted) -> None:
    current = blind.unseen(ev.local, ev.views)
    m = d.memory
    if not current and not d.book.unseen_since and not m.blind:
        d.update(unseen=())
        return
    open_ = {b.unseen: b for b in m.blind}
    r = blind.rule(ev.mono, current, d.book.unseen_since, open_,
                   [w for w, b in open_.items() if b.phase == Phase.FROZEN_HERE], d.s.blind_after,
                   blind.frozen(ev.local), ev.paused)
    d.update(unseen_since=r.since, unseen=r.now_unseen, paused=ev.paused)
    for what in r.seen:
        _resolve(d, open_[what], ev.local)
    for u in r.open:
        _open(d, u, ev.local, d.wall - (ev.mono - r.since.get(u.what, ev.mono)))
    for what in r.frozen:
        _frozen(d, open_[what], next(u for u in current if u.what == what), ev.local)


def _replace_blind(d: Draft, old: Incident | None, new: Incident | None) -> None:
    kept = tuple(b for b in d.memory.blind if b is not old and (old is None or b.id != old.id))
    d.remember(blind=(*kept, new) if new is not None else kept)
    d.save()


def _open(d: Draft, u: blind.Unseen, local: Sequence[Verdict], since: float) -> None:
    engine = ",".join(u.engines) or "-"
    incident = d.memory.incident
    other = incident.id if incident is not None else ""
    inc = Incident(d.new_id(since, engine, Kind.BLIND, salt=u.what), engine, Kind.BLIND, since,
                   blind.summary(u, local, iso(since), d.wall - since, other),
                   # a freeze confirmed here is said in this alert; else when it is confirmed (blind_frozen)
                   Phase.FROZEN_HERE if u.node and blind.frozen(local) else Phase.OPEN, unseen=u.what)
    stalled = bool(u.node and blind.stalls(local))
    _replace_blind(d, None, inc)
    d.out.append(Say(f"blind incident {inc.id}: {inc.reason}"))
    details: dict[str, Any] = {
        "kind": "blind", "unseen": u.name, "why": u.why, "since": iso(since), "blind_for": round(d.wall - since, 1),
        "node": u.node or None, "here": blind.here(local), "stalled_here": stalled,
        "frozen_here": inc.phase == Phase.FROZEN_HERE,
        "incident": other or None, "incident_kind": incident.kind.value if incident is not None else None}
    d.emit(inc, "incident_opened", reason=inc.reason, unseen=u.what, why=u.why, stalled_here=stalled)
    d.notify(inc, "blind", inc.reason, details, state="blind", runbook=u.runbook)


def _frozen(d: Draft, inc: Incident, u: blind.Unseen, local: Sequence[Verdict]) -> None:
    new = replace(inc, phase=Phase.FROZEN_HERE)
    _replace_blind(d, inc, new)
    text = blind.frozen_summary(u, local, iso(inc.detected), d.wall - inc.detected)
    d.out.append(Say(f"blind incident {inc.id}: {text}"))
    d.emit(new, "blind_frozen", reason=text, unseen=u.what, why=u.why)
    d.notify(new, "blind_frozen", text, {"kind": "blind", "unseen": u.name, "why": u.why, "node": u.node,
                                         "since": iso(inc.detected), "here": blind.here(local), "frozen_here": True},
             state="blind", runbook=Runbook.BLIND_NODE)


def _resolve(d: Draft, inc: Incident, local: Sequence[Verdict]) -> None:
    _replace_blind(d, inc, None)
    lasted = round(d.wall - inc.detected, 1)
    how = blind.resolved(name(inc), lasted)
    d.out.append(Say(f"blind incident {inc.id} resolved: {how}"))
    state = next((v.state.value for v in local if v.engine in inc.engine.split(",")), "seen")
    d.emit(inc, "resolved", how=how, lasted=lasted)
    d.notify(inc, "resolved", how, {"kind": "blind", "unseen": name(inc), "lasted": lasted,
                                    "here": blind.here(local)}, resolved=True, state=state,
             runbook=blind.Unseen(inc.unseen, "").runbook)
