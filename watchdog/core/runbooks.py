"""The runbooks' names: one page per verdict and cause under ``runbooks/`` in the project (``runbooks/<name>.md``).

Pure vocabulary: the evidence names the runbook of a freeze's cause, the act stage the runbook of what it alerts on,
the service and the CLI print it; every page's file exists (a test holds this both ways).
"""

from __future__ import annotations

from enum import StrEnum


class Runbook(StrEnum):
    # frozen, by what the stacks showed
    STOPPED_RANK = "frozen-stopped-rank"  # a rank is stopped (SIGSTOP, a debugger, a cgroup freezer)
    PEER_WAIT = "frozen-waiting-on-peer"  # a collective waits on a peer (this node or the other)
    GPU_WAIT = "frozen-waiting-on-gpu"  # a rank waits on its own GPU (a kernel that spins or never ends)
    ALL_PARKED = "frozen-all-parked"  # every rank parked, nothing to blame: the poll-parking question
    DIVERGED = "frozen-ranks-diverged"  # ranks in collectives that never match: one entered one its peers never join
    LIVELOCK = "frozen-livelock"  # EngineCore's loop turns and burns CPU, no rank in the model
    ADMISSION_STALL = "frozen-admission-stall"  # requests wait, none runs
    FROZEN = "frozen"  # frozen with no stacks to say why (capture off, denied, incomplete): the metric window decided
    # down
    DOWN_API = "down-api-server"  # the API server does not answer
    DOWN_RANK_LOST = "down-rank-lost"  # a rank's process is gone (this node or another)
    DOWN_ENGINE_ERROR = "down-engine-error"  # the engine died of an error its log names (CUDA, out of memory, NCCL)
    # blind: the watchdog cannot see
    BLIND_PAGE = "blind-page"  # /metrics unreadable (garbage, refused, timing out)
    BLIND_NODE = "blind-node"  # another node cannot be reached (and an engine frozen while it cannot be seen)
    # the response
    STARTING_TOO_LONG = "starting-too-long"
    RESTART_FAILED = "restart-failed"
    GAVE_UP = "gave-up"
    WATCHDOG_SILENT = "watchdog-silent"  # the watchdog's own heartbeat or metrics went quiet

    @property
    def path(self) -> str:
        """The page's path in the project (and under a published ``runbook_base``)."""
        return f"runbooks/{self.value}.md"


def runbook_link(runbook: Runbook, base: str = "") -> str:
    """Where an operator reads it: ``base`` (a URL or directory the pages are published at, "" for the project's own
    ``runbooks/``) joined with the page's name."""
    if not base:
        return runbook.path
    return f"{base.rstrip('/')}/{runbook.value}.md"
