"""The other nodes of a stack: ``[[nodes]]``, each reached over OpenSSH with a key bound to a forced command. Pure.

A node is named once here; ``node = "<name>"`` on a restart step runs that step there (``"local"`` is this host).
Its log tail (``journal_unit``, ``docker_container`` or ``log_file``) is read on that node; its pre-start hook runs
there, right before the first starting step on that node (before the first starting step overall when it has none:
`watchdog.act.restart`); with ``remove_shm`` the stale /dev/shm segments there are removed before the first start.
`watchdog.nodes` is the transport and the agent at the other end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from watchdog.core.processes import LOCAL  # this host, as a node's name

MAX_LOG_LINES = 5000  # the agent's cap on a log tail (watchdog.nodes.agent, verb context)
# The ranges a node's agent takes (`watchdog.nodes.arguments`), and so the ones the head's config may give when it
# has [[nodes]] (`check_nodes`): one place, so that a value the head accepts is never one every node refuses
CAPTURE_ROUNDS = (1, 5)  # [capture] rounds: the verb stacks' rounds
CAPTURE_GAP = (0.0, 30.0)  # [capture] gap, seconds
CAPTURE_TIMEOUT = (0.5, 60.0)  # [capture] timeout, seconds: one py-spy dump
LIVENESS_INTERVAL = (0.2, 60.0)  # [[nodes]] liveness_interval, seconds: the verb liveness's interval


class CaptureSettings(Protocol):
    """What of [capture] goes to every node's agent (`watchdog.config.load.CaptureSection`)."""

    @property
    def rounds(self) -> int: ...

    @property
    def gap(self) -> float: ...

    @property
    def timeout(self) -> float: ...
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True, slots=True)
class NodeSection:
    """One other node: ``[[nodes]]``."""

    name: str = ""  # how steps, verdicts and bundles name it
    host: str = ""  # address or DNS name, as ssh takes it
    user: str = "root"
    port: int = 22
    identity_file: str = ""  # the private key whose public half is bound to the forced command there
    known_hosts_file: str = ""  # the node's host key: checked strictly, never learned on first use
    connect_timeout: float = 5.0  # ssh ConnectTimeout, and the wait for the shared connection
    call_timeout: float = 30.0  # one call (list, stacks, run...) ends after this, whatever the node does
    max_bytes: int = 16 * 1024 * 1024  # the most one call may answer; more and the call is ended
    liveness_interval: float = 2.0  # the node reports its ranks this often
    liveness_stale: float = 6.0  # no report for this long: the node cannot be seen (blind for that node)
    pre_start: tuple[str, ...] = ()  # argv run there before the first starting step on this node (its agent allows it)
    pre_start_timeout: float = 120.0
    journal_unit: str = ""  # the engine's log there: a systemd unit, or
    docker_container: str = ""  # a container, or
    log_file: str = ""  # a file
    log_lines: int = 200
    remove_shm: bool = False  # before the first start, remove the segments a dead engine left in /dev/shm there


def check_nodes(nodes: tuple[NodeSection, ...], capture: CaptureSettings | None = None) -> None:
    """Raises ValueError naming the key. With nodes, ``capture``'s settings must be ones their agents take."""
    if nodes and capture is not None:
        for key, (low, high) in (("rounds", CAPTURE_ROUNDS), ("gap", CAPTURE_GAP), ("timeout", CAPTURE_TIMEOUT)):
            value = getattr(capture, key)
            if not low <= value <= high:
                raise ValueError(f"capture.{key} must be {low:g} to {high:g} when [[nodes]] are configured (the "
                                 f"most a node's agent takes), got {value!r}")
    seen: set[str] = set()
    for i, n in enumerate(nodes):
        where = f"nodes[{i}]"
        if not _NAME.match(n.name) or n.name == LOCAL:
            raise ValueError(f"{where}.name: {n.name!r} is not a usable node name (letters, digits, _.-; "
                             f"not {LOCAL!r})")
        if n.name in seen:
            raise ValueError(f"{where}.name: {n.name!r} names two nodes")
        seen.add(n.name)
        for key in ("host", "identity_file", "known_hosts_file"):
            if not getattr(n, key):
                raise ValueError(f"{where}.{key}: required (the node is reached with key auth and a strict host "
                                 "key check only)")
        if n.host.startswith("-") or n.user.startswith("-") or not n.user:
            raise ValueError(f"{where}: host and user must not be empty or start with '-'")
        if not 0 < n.port <= 65535:
            raise ValueError(f"{where}.port must be 1..65535, got {n.port}")
        for key in ("connect_timeout", "call_timeout", "liveness_interval", "liveness_stale", "pre_start_timeout"):
            if not getattr(n, key) > 0:
                raise ValueError(f"{where}.{key} must be greater than 0, got {getattr(n, key)!r}")
        low, high = LIVENESS_INTERVAL
        if not low <= n.liveness_interval <= high:
            raise ValueError(f"{where}.liveness_interval must be {low:g} to {high:g} (what the node's agent takes), "
                             f"got {n.liveness_interval!r}")
        if n.liveness_stale <= n.liveness_interval:
            raise ValueError(f"{where}.liveness_stale must exceed liveness_interval")
        if n.max_bytes < 4096 or not 0 <= n.log_lines <= MAX_LOG_LINES:
            raise ValueError(f"{where}: max_bytes must be at least 4096 and log_lines 0 to {MAX_LOG_LINES} (the "
                             "most a node's agent sends)")
        if sum(bool(x) for x in (n.log_file, n.journal_unit, n.docker_container)) > 1:
            raise ValueError(f"{where}: give one of log_file, journal_unit, docker_container")


def node_names(nodes: tuple[NodeSection, ...]) -> tuple[str, ...]:
    return (LOCAL, *(n.name for n in nodes))
