"""What a capture holds: the engine's processes, and py-spy dumps of each with /proc facts beside them. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from watchdog.core.ring import Ring
from watchdog.core.roles import Role


@dataclass(frozen=True, slots=True)
class EngineProcess:
    pid: int
    role: Role
    title: str
    ranks: dict[str, int] = field(default_factory=dict)
    ppid: int | None = None
    node: str = "local"  # the node it runs on ([[nodes]] name); "local" is this host
    node_pid: int | None = None  # its pid there, when ``pid`` is only the capture's key (another node's process)

    @property
    def label(self) -> str:
        """A short, unique-ish name for reports: the title when it has one, and its node when not this host."""
        name = self.title if self.title else f"{self.role}[{self.real_pid}]"
        where = f" on node {self.node}"
        return name if self.node == "local" or name.endswith(where) else name + where

    @property
    def real_pid(self) -> int:
        """The pid on its own node."""
        return self.node_pid if self.node_pid is not None else self.pid


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
class Capture:
    processes: tuple[EngineProcess, ...]
    rounds: tuple[dict[int, Dump], ...]  # one dict per capture round, by pid
    problems: tuple[str, ...] = ()
    options: dict[str, object] = field(default_factory=dict)
    # one --native dump of each process holding a GPU, after the rounds: evidence beside the Python stacks (their
    # host waits are in CUDA/NCCL frames); the rounds, not these, decide (native frames churn inside a wait)
    native: dict[int, Dump] = field(default_factory=dict)
    # other nodes whose stacks could not be taken at all: their ranks are missing, so "every rank" was not read
    unseen_nodes: tuple[str, ...] = ()
    # the broadcast rings' flags, read once after the rounds (watchdog.evidence.collect.ring): a written block that a
    # parked reader never took is the lost wake-up
    rings: tuple[Ring, ...] = ()

    @property
    def complete(self) -> bool:
        return bool(self.processes) and all(d.ok for r in self.rounds for d in r.values()) and not self.unseen_nodes


@dataclass(frozen=True, slots=True)
class NodeContext:
    """Another node's part of the bundle's context, as its agent answered (``reached`` False: why not, in problems)."""

    reached: bool
    log_tail: str = ""
    log_source: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    shm_segments: int | None = None
    problems: tuple[str, ...] = ()
