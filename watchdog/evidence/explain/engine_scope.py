"""Which processes serve which engine of a data-parallel server: one /metrics page names each engine (``engine="1"``),
one process tree holds them all, and only an engine's own processes may decide its suspicion. Pure.

With ``--data-parallel-size N`` vLLM runs ``VLLM::EngineCore_DP<n>`` for engine ``n`` and its workers under it,
titled ``VLLM::Worker_DP<n>...`` when their groups are larger than one, plain ``VLLM::Worker`` when not: then only
the parent tells which engine a worker serves (`shared/reference/vllm-liveness.md`, seen on 0.32.0). Without it (no
process carries a DP rank) every process is the one engine's.
"""

from __future__ import annotations

from collections.abc import Iterable

from watchdog.core.processes import EngineProcess, ProcessId
from watchdog.core.roles import ENGINE_ROLES

DP = "DP"


def engine_processes(processes: Iterable[EngineProcess], engine: str) -> frozenset[ProcessId] | None:
    """The ids of the processes that run engine ``engine`` (the page's label), or None when the tree is not
    data-parallel (or ``engine`` names no DP rank): then every process is the engine's.

    Engine ``n``'s are its ``EngineCore_DP<n>``, every process titled with ``DP<n>``, and every process whose parent
    chain (on its own node, through the processes known) reaches one of those. An engine process that can be told
    to no engine (a worker whose parent is not known, a Ray actor) is kept in every engine's scope: its work may be
    this engine's, and calling a working engine frozen costs a restart."""
    procs = list(processes)
    if not engine.isdigit() or not any(DP in p.ranks for p in procs if p.role in ENGINE_ROLES):
        return None
    want = int(engine)
    by_id = {p.id: p for p in procs}

    def owner(p: EngineProcess) -> int | None:
        seen: set[ProcessId] = set()
        cur: EngineProcess | None = p
        while cur is not None and cur.id not in seen:
            seen.add(cur.id)
            if DP in cur.ranks and cur.role in ENGINE_ROLES:
                return cur.ranks[DP]
            cur = by_id.get(ProcessId(cur.node, cur.ppid)) if cur.ppid is not None else None
        return None

    mine: set[ProcessId] = set()
    for p in procs:
        if p.role not in ENGINE_ROLES:
            continue
        if (n := owner(p)) is None or n == want:
            mine.add(p.id)
    return frozenset(mine)
