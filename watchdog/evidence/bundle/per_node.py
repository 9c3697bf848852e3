"""What a capture and its context hold per node: which node's evidence is present, partial or missing. Pure.

The bundle's manifest (and so ``watchdog dump --json``) carries one entry per node, ``local`` (this host) first,
then every ``[[nodes]]`` entry in the order written:

- ``processes``: each engine process found there, with its pid on that node, role, ranks, title;
- ``dumps``: how many py-spy dumps of them came back (``ok``) and how many failed; ``stacks``: all, some or none;
- ``reachable`` (another node: the stacks call got through), ``clock_offset_s`` (its wall clock minus ours);
- ``log_source``, ``log_lines``: the node's own log tail (file ``log-tail.txt`` for this host,
  ``log-tail-<node>.txt`` for another), ``versions`` and ``shm_segments`` there;
- ``problems``: what went wrong for that node alone (each `Problem` names its node: "node worker1: unreachable: ...");
- ``evidence``: ``complete`` (every process's every dump), ``partial`` or ``missing`` (no stack at all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from watchdog.core.processes import LOCAL, Capture, NodeContext, Problem


def _lines(text: str) -> int:
    return len(text.splitlines())


def per_node(capture: Capture, contexts: dict[str, NodeContext], problems: Sequence[Problem],
             local_log_source: str = "", local_log_tail: str = "") -> dict[str, dict[str, Any]]:
    """One entry per node (see the module's doc); ``problems``: the capture's and the context's, all nodes."""
    reach = {n.node: n for n in capture.nodes}
    names = [LOCAL, *reach, *(n for n in contexts if n not in reach)]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        procs = [p for p in capture.processes if p.node == name]
        dumps = [d for p in procs for d in capture.dumps_of(p)]
        ok = sum(1 for d in dumps if d.ok)
        mine = sorted({str(p) for p in problems if p.node == name})
        entry: dict[str, Any] = {
            "processes": [{"pid": p.pid, "role": str(p.role), "ranks": p.ranks,
                           "title": p.title.removesuffix(f" on node {name}")} for p in procs],
            "dumps": {"ok": ok, "failed": len(dumps) - ok},
            "stacks": "none" if not ok else ("all" if ok == len(dumps) and len(dumps) >= len(procs) else "some"),
        }
        if name == LOCAL:
            entry.update(reachable=True, clock_offset_s=0.0, log_source=local_log_source,
                         log_lines=_lines(local_log_tail))
        else:
            asked, ctx = reach.get(name), contexts.get(name)
            entry.update(reachable=asked.reachable if asked else ctx is not None and ctx.reached,
                         clock_offset_s=asked.clock_offset_s if asked else None,
                         log_source=ctx.log_source if ctx else "", log_lines=_lines(ctx.log_tail) if ctx else 0,
                         versions=dict(ctx.versions) if ctx else {},
                         shm_segments=ctx.shm_segments if ctx else None)
        entry["problems"] = mine
        entry["evidence"] = ("missing" if entry["stacks"] == "none" else
                             "complete" if entry["stacks"] == "all" and procs else "partial")
        out[name] = entry
    return out


def node_lines(nodes: dict[str, dict[str, Any]]) -> list[str]:
    """One line per node for people (the summary, `watchdog dump`)."""
    lines = []
    for name, n in nodes.items():
        where = "this host" if name == LOCAL else f"node {name}"
        offset = n.get("clock_offset_s")
        clock = f", clock offset {offset:+.3f} s" if name != LOCAL and isinstance(offset, int | float) else ""
        log = f", log {n['log_source']} ({n['log_lines']} lines)" if n.get("log_source") else ", no log"
        head = (f"{where}: evidence {n['evidence'].upper()}: {len(n['processes'])} processes, "
                f"{n['dumps']['ok']} dumps ok, {n['dumps']['failed']} failed{clock}{log}")
        if not n["reachable"]:
            head += ", NOT REACHED"
        lines.append(head + "".join(f"; {p}" for p in n["problems"][:3]))
    return lines
