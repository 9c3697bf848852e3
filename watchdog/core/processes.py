"""What a capture holds: the engine's processes, and py-spy dumps of each with /proc facts beside them; what went
wrong taking them, each on its node. Pure data.

A process is known by its node and its pid there (`ProcessId`): pids of two nodes collide, so the capture's rounds
are keyed by both."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from watchdog.core.ring import Ring
from watchdog.core.roles import Role

LOCAL = "local"  # this host, as a node's name


class ProcessId(NamedTuple):
    """One process of the stack: the node it runs on ([[nodes]] name, or "local") and its pid there."""

    node: str
    pid: int

    def __str__(self) -> str:
        """``1234`` on this host, ``worker1:1234`` on another node."""
        return str(self.pid) if self.node == LOCAL else f"{self.node}:{self.pid}"


@dataclass(frozen=True, slots=True)
class EngineProcess:
    pid: int  # on its own node
    role: Role
    title: str
    ranks: dict[str, int] = field(default_factory=dict)
    ppid: int | None = None
    node: str = LOCAL  # the node it runs on ([[nodes]] name); "local" is this host

    @property
    def id(self) -> ProcessId:
        """Its key in a capture's rounds."""
        return ProcessId(self.node, self.pid)

    @property
    def label(self) -> str:
        """A short, unique-ish name for reports: the title when it has one, and its node when not this host."""
        name = self.title if self.title else f"{self.role}[{self.pid}]"
        where = f" on node {self.node}"
        return name if self.node == LOCAL or name.endswith(where) else name + where


@dataclass(frozen=True, order=True, slots=True)
class Problem:
    """What went wrong taking the evidence (with its fix, where there is one), and the node it went wrong on."""

    text: str
    node: str = LOCAL

    def __str__(self) -> str:
        return self.text if self.node == LOCAL else f"node {self.node}: {self.text}"


@dataclass(frozen=True, slots=True)
class ProcFacts:
    state: str  # /proc state letter: R, S, D, T, t, Z
    wchan: str
    cpu_seconds: float
    threads: int


class Failure(StrEnum):
    """Why a dump is missing (or, for NATIVE_UNREADABLE, only Python frames): one kind, named once, at capture."""

    DENIED = "denied"  # ptrace refused: no CAP_SYS_PTRACE, yama ptrace_scope, a container
    MISSING = "missing"  # no py-spy
    TIMEOUT = "timeout"  # py-spy hung: the process may be in uninterruptible sleep (state D)
    NATIVE_UNREADABLE = "native_unreadable"  # --native failed; the dump was retried without it (Python-only)
    GONE = "gone"  # the process exited
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Dump:
    """One py-spy dump of one process."""

    pid: int
    t: float
    ok: bool
    output: str  # py-spy's JSON when ok
    error: str = ""
    nonblocking: bool = False
    facts: ProcFacts | None = None
    seconds: float = 0.0
    failure: Failure | None = None  # set when not ok, and on an ok dump that lost its native frames
    # (CPU seconds, seconds) the process used in the pause just before this round, while no py-spy held it: its
    # true rate (a blocking dump suspends it, and slow dumps of other processes stretch the rounds apart)
    quiet: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class NodeReach:
    """What one capture heard from another node it asked for stacks."""
    node: str
    processes: int  # how many of its processes came back
    clock_offset_s: float | None  # its wall clock minus ours (None: not known)
    reachable: bool  # False: the call did not get through


@dataclass(frozen=True, slots=True)
class Capture:
    processes: tuple[EngineProcess, ...]
    rounds: tuple[dict[ProcessId, Dump], ...]  # one dict per capture round, by process
    problems: tuple[Problem, ...] = ()
    options: dict[str, object] = field(default_factory=dict)  # the capture's settings, as the manifest says them
    # one --native dump of each process holding a GPU, after the rounds: evidence beside the Python stacks (their
    # host waits are in CUDA/NCCL frames); the rounds, not these, decide (native frames churn inside a wait)
    native: dict[ProcessId, Dump] = field(default_factory=dict)
    # other nodes whose stacks could not be taken at all: their ranks are missing, so "every rank" was not read
    unseen_nodes: tuple[str, ...] = ()
    # the broadcast rings' flags, read once after the rounds (watchdog.evidence.collect.ring): a written block that a
    # parked reader never took is the lost wake-up
    rings: tuple[Ring, ...] = ()
    nodes: tuple[NodeReach, ...] = ()  # every other node asked, reached or not (`watchdog.nodes.remote.merge`)

    @property
    def complete(self) -> bool:
        return bool(self.processes) and all(d.ok for r in self.rounds for d in r.values()) and not self.unseen_nodes

    def dumps_of(self, p: EngineProcess) -> list[Dump]:
        """``p``'s dump in each round that holds one, in round order."""
        return [r[p.id] for r in self.rounds if p.id in r]


@dataclass(frozen=True, slots=True)
class NodeContext:
    """Another node's part of the bundle's context, as its agent answered (``reached`` False: why not, in problems)."""

    reached: bool
    log_tail: str = ""
    log_source: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    shm_segments: int | None = None
    problems: tuple[Problem, ...] = ()
