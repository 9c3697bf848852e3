"""What the nodes' liveness reports mean for the stack. Pure: reports and times in, a view per node out.

- a rank ``gone`` or ``zombie`` on any node: ``rank_lost``, naming rank and node, at once (vLLM's engine cannot go on
  without it: see docs/design.md "Two nodes: how it works");
- a rank ``stopped``: ``rank_stopped`` (said; the freeze itself is the judge's and the stacks' to decide);
- no report for ``stale`` seconds, or the node cannot be reached: ``blind`` for that node, never healthy;
- reports with no engine rank at all: ``no_ranks`` (the engine is not running there);
- else ``ok``.

`overlay` turns these into the engine verdicts the act stage sees: a lost rank makes a healthy-looking engine
``down`` (it cannot serve), and names itself first in a ``down`` the head saw on its own (vLLM shuts the head down
about 2 s after a remote rank dies: the lost rank is the cause, "connection refused" the consequence); a blind node
makes a healthy-looking or frozen engine ``blind`` (cannot judge; blind never restarts): with ranks on that node
every step needs it, so a freeze may be the cut itself (a probe sent across a cut link hangs: seen on the real
pair), and a restart could not reach that node's steps after stopping the head's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from watchdog.core.roles import ENGINE_ROLES
from watchdog.core.types import State, Verdict
from watchdog.nodes.protocol import RankState


@dataclass(frozen=True, slots=True)
class NodeView:
    node: str
    status: str  # ok | rank_lost | rank_stopped | no_ranks | blind
    reason: str
    ranks: tuple[RankState, ...] = ()


def view(node: str, ranks: tuple[RankState, ...] | None, age: float | None, stale: float,
         error: str = "") -> NodeView:
    """``ranks``/``age``: the last report and its age in seconds (None: none yet); ``error``: why the stream broke."""
    if ranks is None or age is None or age > stale:
        why = error or ("no liveness report yet" if age is None else f"no liveness report for {age:.0f}s")
        return NodeView(node, "blind", f"cannot see node {node}: {why}", ranks or ())
    engine = [r for r in ranks if r.role in ENGINE_ROLES]
    lost = [r for r in engine if r.state in ("gone", "zombie")]
    if lost:
        names = ", ".join(f"{r.title} (pid {r.pid}) {'exited' if r.state == 'gone' else 'is a zombie'}"
                          for r in lost)
        return NodeView(node, "rank_lost", f"{names} on node {node}", ranks)
    stopped = [r for r in engine if r.state == "stopped"]
    if stopped:
        return NodeView(node, "rank_stopped", ", ".join(f"{r.title} (pid {r.pid}) stopped on node {node}"
                                                         for r in stopped), ranks)
    if not engine:
        return NodeView(node, "no_ranks", f"no engine rank on node {node}", ranks)
    return NodeView(node, "ok", f"{len(engine)} rank(s) running on node {node}", ranks)


HEALTHY = (State.IDLE, State.WORKING, State.SUSPECT)


def overlay(verdicts: list[Verdict], views: list[NodeView]) -> list[Verdict]:
    """The engine verdicts with what the other nodes say: a lost rank is down, a node not seen is blind."""
    lost = [v for v in views if v.status == "rank_lost"]
    blind = [v for v in views if v.status == "blind"]
    out = []
    for v in verdicts:
        seen = v
        if lost and v.state in (*HEALTHY, State.FROZEN, State.DOWN):
            ours = [v.reason] if v.state == State.DOWN else []
            seen = replace(v, state=State.DOWN, reason="; ".join([*(x.reason for x in lost), *ours]))
        elif blind and v.state in (*HEALTHY, State.FROZEN):
            ours = [v.reason] if v.state == State.FROZEN else []
            seen = replace(v, state=State.BLIND, reason="; ".join([*(x.reason for x in blind), *ours]))
        out.append(seen)
    return out
