"""A watchdog that cannot see says so: what cannot be seen now, how long, and the words of its alert. Pure: the
verdicts and the nodes' views in, time as data, rulings and text out. The incidents are kept by the act stage's
sight module.

Two things can go unseen: the engine's page (the local verdict ``blind``: unreadable, refused, garbage, no engine
series) and another node of ``[[nodes]]`` (its view ``blind``: no liveness report, or it cannot be reached). Each
is followed on its own, keyed ``page`` or ``node:<name>``. Unseen for ``[alerts] blind_after`` seconds, it becomes a
blind incident (alerted ``blind``); seen again, the incident is ``resolved``. While a node cannot be seen, a stall
here (the local verdict frozen, or suspect with work pending and no progress) is said with it: "frozen here while
node X cannot be seen" (alerted ``blind_frozen`` when the freeze is confirmed after the blind alert). Nothing here ever
restarts: a restart cannot be shown to help what cannot be seen (docs/blind.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from watchdog.core.runbooks import Runbook
from watchdog.core.types import State, Verdict
from watchdog.nodes.liveness import NodeView

PAGE = "page"
NODE = "node:"


@dataclass(frozen=True, slots=True)
class Unseen:
    """One thing the watchdog cannot see now, and why."""

    what: str  # "page" | "node:<name>"
    why: str  # the scrape's error, or the node view's reason
    engines: tuple[str, ...] = ()  # the engines it hides: the page's unreadable ones; for a node, every engine here

    @property
    def node(self) -> str:
        return self.what[len(NODE):] if self.what.startswith(NODE) else ""

    @property
    def runbook(self) -> Runbook:
        return Runbook.BLIND_NODE if self.node else Runbook.BLIND_PAGE

    @property
    def name(self) -> str:
        """How a sentence names it."""
        return f"node {self.node}" if self.node else "the engine's page"


def unseen(local: Sequence[Verdict], views: Sequence[NodeView]) -> list[Unseen]:
    """What cannot be seen in this pass: ``local`` are the verdicts of this node's page alone (no overlay)."""
    out: list[Unseen] = []
    page = [v for v in local if v.state == State.BLIND]
    if page:
        why = "; ".join(dict.fromkeys(v.reason for v in page))  # usually one reason for every engine
        out.append(Unseen(PAGE, why, tuple(v.engine for v in page)))
    for view in views:
        if view.status == "blind":
            why = view.reason.removeprefix(f"cannot see node {view.node}: ")
            out.append(Unseen(NODE + view.node, why, tuple(v.engine for v in local)))
    return out


def stalls(local: Sequence[Verdict]) -> list[Verdict]:
    """The local evidence of a stall: frozen, or suspect with work pending and no progress (said in a blind alert)."""
    return [v for v in local if v.state == State.FROZEN or (v.state == State.SUSPECT and v.stalled_for > 0)]


def frozen(local: Sequence[Verdict]) -> bool:
    """A freeze here, confirmed by the judge: what a blind node incident says later (``blind_frozen``), once."""
    return any(v.state == State.FROZEN for v in local)


@dataclass(frozen=True, slots=True)
class SightRuling:
    since: dict[str, float]  # what -> when it was first not seen (kept by the caller for the next pass)
    open: tuple[Unseen, ...] = ()  # unseen for blind_after or longer and no incident yet: open one, alert
    frozen: tuple[str, ...] = ()  # open node incidents not yet said frozen, now with a freeze here: say it
    seen: tuple[str, ...] = ()  # open incidents whose thing is seen again: resolve
    now_unseen: tuple[Unseen, ...] = ()  # everything not seen in this pass


def rule(now: float, current: Sequence[Unseen], since: Mapping[str, float], incidents: Collection[str],
         said_frozen: Collection[str], blind_after: float, frozen_here: bool, paused: bool = False) -> SightRuling:
    """One pass of sight, time as data (``now`` and ``since`` on one clock).

    ``incidents``: the things with a blind incident open; ``said_frozen``: those of them already alerted as frozen
    here; ``frozen_here``: the judge calls an engine here frozen. While ``paused`` (maintenance: a node rebooted on
    purpose is expected out of sight) no incident opens, but the time unseen keeps counting, so a node still unseen
    when the pause ends is alerted at once."""
    kept = {u.what: since.get(u.what, now) for u in current}
    opened = tuple(u for u in current if u.what not in incidents and now - kept[u.what] >= blind_after
                   and not paused)
    said = tuple(u.what for u in current if frozen_here and u.node and u.what in incidents
                 and u.what not in said_frozen)
    seen = tuple(w for w in incidents if w not in kept)
    return SightRuling(kept, opened, said, seen, tuple(current))


# -- the words ---------------------------------------------------------------------------------------------------


def here(local: Sequence[Verdict]) -> str:
    """What this node's page says of each engine, stalls first: "engine 0 frozen (no progress for 45s ...)"."""
    stalled = stalls(local)
    shown = stalled or list(local)
    if not shown:
        return "no engine verdict here yet"
    return "; ".join(f"engine {v.engine} is {v.state.value} ({v.reason})" if v in stalled
                     else f"engine {v.engine} is {v.state.value}" for v in shown)


NOT_ACTED = "nothing is restarted on blindness alone (a restart cannot be shown to help what cannot be seen)"


def summary(u: Unseen, local: Sequence[Verdict], since: str, lasted: float, incident: str = "") -> str:
    """The blind alert's line: what cannot be seen since when and why; with a node, what the engine does here
    (frozen or stalling here said first: both facts in one line); ``incident``: an open incident to name."""
    unseen_for = f"{u.name} {'cannot be seen' if u.node else 'has not been read'} since {since} ({lasted:.0f}s): " \
                 f"{u.why}"
    stalled = stalls(local) if u.node else []
    if stalled:
        line = f"{here(stalled)} here, while {unseen_for}. {frozen_advice(u.node)}"
    elif u.node:
        line = f"{unseen_for}; here: {here(local)}. The engine cannot be judged while {u.name} cannot be seen; " \
               f"{NOT_ACTED}"
    else:
        line = f"{unseen_for} (engines {', '.join(u.engines) or '-'}); the engine cannot be judged; {NOT_ACTED}"
    return f"{line}. Incident {incident} stays open beside this one." if incident else f"{line}."


def frozen_advice(node: str) -> str:
    return (f"Not restarted: a restart could not reach node {node}'s steps. If node {node} hangs, power-cycle it out "
            f"of band, then run `watchdog reset`")


def frozen_summary(u: Unseen, local: Sequence[Verdict], since: str, lasted: float) -> str:
    """The later alert when the engine stalls here after its node's blind alert."""
    return (f"{here(stalls(local))} here, while {u.name} cannot be seen since {since} ({lasted:.0f}s): {u.why}. "
            f"{frozen_advice(u.node)}.")


def resolved(name: str, lasted: float) -> str:
    return f"{name} is seen again after {lasted:.0f}s"


def name_of(what: str) -> str:
    return Unseen(what, "").name
