"""The one vocabulary of process roles, and how a process title names its role and ranks. Pure.

Discovery (``/proc``), explanation (a dump's title) and the bundle all speak it: ``api_server``, ``dp_coordinator``,
``engine_core``, ``worker`` (a vLLM or Ray worker rank), ``scheduler`` (SGLang's, which is engine and rank in one),
``process`` (titled by the engine, of no known role).
"""

from __future__ import annotations

import re
from enum import StrEnum


class Role(StrEnum):
    API_SERVER = "api_server"
    DP_COORDINATOR = "dp_coordinator"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"
    SCHEDULER = "scheduler"
    PROCESS = "process"


# Roles whose processes run the engine's loop or a rank: the ones whose stacks decide a suspicion.
ENGINE_ROLES = frozenset({Role.ENGINE_CORE, Role.WORKER, Role.SCHEDULER})
# Report order: the server first, then the coordinator, the engine, the ranks.
ORDER = {Role.API_SERVER: 0, Role.DP_COORDINATOR: 1, Role.ENGINE_CORE: 2, Role.SCHEDULER: 2, Role.WORKER: 3}

_RANK = re.compile(r"_(DP|PP|TP|EP)(\d+)")
# An engine title anywhere in a line (a dump's "Process 123: VLLM::Worker_TP1" header, a Ray prefix).
_TITLE = re.compile(r"\b(?:VLLM|sglang|ray)::(\S+)|\b(RayWorkerWrapper|RayWorkerVllm)\b")
_BY_NAME = (("EngineCore", Role.ENGINE_CORE), ("Worker", Role.WORKER), ("APIServer", Role.API_SERVER),
            ("DPCoordinator", Role.DP_COORDINATOR), ("scheduler", Role.SCHEDULER))


def ranks_of(name: str) -> dict[str, int]:
    """``Worker_DP1_TP3`` -> {"DP": 1, "TP": 3}."""
    return {k: int(v) for k, v in _RANK.findall(name)}


def role_of_name(name: str) -> Role:
    """The role a title's name (``EngineCore_DP1``, ``Worker_TP0``, ``scheduler_TP2``, ``RayWorkerWrapper``) says."""
    return next((role for key, role in _BY_NAME if key in name), Role.PROCESS)


def parse_title(title: str, prefix: str = "VLLM::") -> tuple[Role, dict[str, int]] | None:
    """(role, ranks) for a process's command line as ``/proc`` shows it, or None when it is not an engine's."""
    head = title.split(" ", 1)[0]
    if head.startswith(prefix):
        name = head[len(prefix):]
        return role_of_name(name), ranks_of(name)
    if head.startswith("sglang::scheduler"):
        return Role.SCHEDULER, ranks_of(head)
    if head.startswith("ray::") and "Worker" in head:
        return Role.WORKER, {}
    return None


def title_in(text: str) -> str:
    """The engine title named somewhere in a dump's header line (``VLLM::Worker_TP1`` -> ``Worker_TP1``), or ""."""
    m = _TITLE.search(text)
    return (m.group(1) or m.group(2)) if m else ""
