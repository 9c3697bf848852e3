"""Blind incidents: the act stage's side of `watchdog.act.blind`, one incident per thing not seen.

Every pass the responder hands over this node's own verdicts (no overlay) and the other nodes' views. The page or a
node unseen for ``[alerts] blind_after`` seconds opens an incident of kind ``blind`` with an id of its own (its
events, its alerts and ``status`` carry it), alerted ``blind`` with the runbook of what cannot be seen; a stall
here while a node cannot be seen is said (in that alert, or later as ``blind_frozen``); sight back, it is
``resolved``. A blind incident sits beside the one incident the restart policy acts on (`Memory.incident`) and never
restarts anything; it is kept in ``recovery.json`` so that a restarted watchdog still resolves it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

from watchdog.act import blind
from watchdog.act.respond import Responder
from watchdog.act.state import Incident, Memory, iso
from watchdog.core.runbooks import Runbook
from watchdog.core.types import Verdict, incident_id
from watchdog.nodes.liveness import NodeView

log = logging.getLogger(__name__)

FROZEN_HERE = "frozen_here"  # a blind node incident's phase once the stall here was said


class Sight:
    """The blind incidents beside ``responder``'s: its memory (saved with it), its clock, switches and outputs."""

    def __init__(self, responder: Responder) -> None:
        self.r = responder
        self.stack, self.blind_after = responder.cfg.engine.name, responder.cfg.alerts.blind_after
        self.alert, self.event, self.save = responder._alert, responder._event, responder._save
        self.since: dict[str, float] = {}  # what -> monotonic time it was first not seen
        self.current: tuple[blind.Unseen, ...] = ()
        self._mono, self._wall = 0.0, 0.0
        for inc in self.memory.blind:
            log.warning("blind incident %s (%s cannot be seen) still open from before; resolved once seen",
                        inc.id, blind.name_of(inc.unseen))

    @property
    def memory(self) -> Memory:
        return self.r.memory

    @property
    def watching(self) -> bool:
        """Something is not seen, or a blind incident is open: every pass counts."""
        return bool(self.since or self.memory.blind)

    def step(self, local: Sequence[Verdict], views: Sequence[NodeView], mono: float) -> None:
        """Before the responder's pass (sight back is said before what it then shows): ``local`` this node's own
        verdicts, ``views`` the other nodes'."""
        wall = self.r.wall()
        self._mono, self._wall = mono, wall
        current = blind.unseen(local, views)
        if not current and not self.since and not self.memory.blind:
            return
        self.r._read_control()  # the operator's switches as of now (a stat; parsed only when changed)
        paused, incident = self.r.control.is_paused(wall), self.memory.incident
        open_ = {b.unseen: b for b in self.memory.blind}
        r = blind.rule(mono, current, self.since, open_, [w for w, b in open_.items() if b.phase == FROZEN_HERE],
                       self.blind_after, blind.frozen(local), paused)
        self.since, self.current = r.since, r.now_unseen
        for what in r.seen:
            self._resolve(open_[what], local, wall)
        for u in r.open:
            self._open(u, local, wall, incident)
        for what in r.frozen:
            self._frozen(open_[what], next(u for u in current if u.what == what), local, wall)

    def _wall_since(self, what: str) -> float:
        return self._wall - (self._mono - self.since.get(what, self._mono))

    def _open(self, u: blind.Unseen, local: Sequence[Verdict], wall: float, incident: Incident | None) -> None:
        since = self._wall_since(u.what)
        engine = ",".join(u.engines) or "-"
        inc = Incident(incident_id(since, self.stack, engine, "blind", secrets.token_hex(2)), engine, "blind", since,
                       unseen=u.what)
        stalled = bool(u.node and blind.stalls(local))
        inc.phase = FROZEN_HERE if u.node and blind.frozen(local) else "open"  # else a freeze is said when confirmed
        other = incident.id if incident is not None else ""
        inc.reason = blind.summary(u, local, iso(since), wall - since, other)
        self.memory.blind.append(inc)
        self.save()
        log.warning("blind incident %s: %s", inc.id, inc.reason)
        details: dict[str, Any] = {
            "kind": "blind", "unseen": u.name, "why": u.why, "since": iso(since), "blind_for": round(wall - since, 1),
            "node": u.node or None, "here": blind.here(local), "stalled_here": stalled,
            "frozen_here": inc.phase == FROZEN_HERE,
            "incident": other or None, "incident_kind": incident.kind if incident is not None else None}
        self.event(inc, "incident_opened", reason=inc.reason, unseen=u.what, why=u.why, stalled_here=stalled)
        self.alert(inc, "blind", inc.reason, details, state="blind", runbook=u.runbook)

    def _frozen(self, inc: Incident, u: blind.Unseen, local: Sequence[Verdict], wall: float) -> None:
        inc.phase = FROZEN_HERE
        self.save()
        text = blind.frozen_summary(u, local, iso(inc.detected), wall - inc.detected)
        log.warning("blind incident %s: %s", inc.id, text)
        self.event(inc, "blind_frozen", reason=text, unseen=u.what, why=u.why)
        self.alert(inc, "blind_frozen", text, {"kind": "blind", "unseen": u.name, "why": u.why, "node": u.node,
                                               "since": iso(inc.detected), "here": blind.here(local),
                                               "frozen_here": True}, state="blind", runbook=Runbook.BLIND_NODE)

    def _resolve(self, inc: Incident, local: Sequence[Verdict], wall: float) -> None:
        self.memory.blind = [b for b in self.memory.blind if b is not inc]
        self.save()
        lasted = round(wall - inc.detected, 1)
        how = blind.resolved(blind.name_of(inc.unseen), lasted)
        log.warning("blind incident %s resolved: %s", inc.id, how)
        state = next((v.state.value for v in local if v.engine in inc.engine.split(",")), "seen")
        self.event(inc, "resolved", how=how, lasted=lasted)
        self.alert(inc, "resolved", how, {"kind": "blind", "unseen": blind.name_of(inc.unseen), "lasted": lasted,
                                          "here": blind.here(local)}, resolved=True, state=state,
                   runbook=blind.Unseen(inc.unseen, "").runbook)

    def status(self) -> list[dict[str, Any]]:
        """What cannot be seen now, since when, and its incident (``status.json`` ``blind``; the exporter's
        ``watchdog_blind_seconds``)."""
        open_ = {b.unseen: b for b in self.memory.blind}
        return [{"what": u.what, "unseen": u.name, "why": u.why, "since": self._wall_since(u.what),
                 "seconds": round(self._mono - self.since.get(u.what, self._mono), 1),
                 "incident": b.id if (b := open_.get(u.what)) else None, "engine": b.engine if b else None}
                for u in self.current]
