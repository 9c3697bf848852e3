"""The data every stage hands to the next: the root of the package's import graph.

scrape -> judge -> evidence -> act -> service: each stage reads these frozen records and produces the next.
Pure: this module imports nothing from the package and does no I/O, so judgement, explanation and policy can
use it freely (``tests/unit/test_layout.py`` holds that rule).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from urllib.parse import urlsplit

# -- what a scrape reads off the page -------------------------------------------------------------------

# Counters that only move when a request emits output: their advance proves the engine serves.
SERVING_COUNTERS = frozenset({"generation_tokens", "request_success"})


@dataclass(frozen=True, slots=True)
class EngineReading:
    """What one engine's series said on one page."""

    engine: str
    model: str = ""
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    counters: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PageReading:
    engines: Mapping[str, EngineReading]
    # how many `vllm:` sample lines the page had (of any name), counted only when no engine was read (the one case
    # the judge says it); 0 otherwise
    vllm_series: int
    dropped: tuple[str, ...] = ()  # values ignored because they were NaN or infinite


# Scrape error kinds, grouped by what they say about the server.
DOWN_KINDS = frozenset({"refused", "unreachable", "http_5xx"})
NO_ANSWER = "no_answer"  # connected, but no response in time: still loading, or the API server is hung
PAGE_HANGS = "page_hangs"  # /metrics gave no answer in time while /health answered: the page alone is stuck


@dataclass(frozen=True, slots=True)
class Scrape:
    """One look at the page. ``t`` is the judge's clock (monotonic seconds); ``wall`` is for people."""

    t: float
    wall: float
    page: PageReading | None
    error_kind: str | None = None
    error: str = ""
    status: int | None = None
    size: int = 0
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return self.page is not None


def base_url(url: str) -> str:
    """The server's base URL, accepting a URL that already ends in /metrics."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {url!r} (expected e.g. http://127.0.0.1:8000)")
    path = parts.path.rstrip("/")
    if path.endswith("/metrics"):
        path = path[: -len("/metrics")]
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The caps on every request to the engine (``[scrape]`` in the config)."""

    connect_timeout: float = 2.0
    read_timeout: float = 5.0
    deadline: float = 10.0  # the whole body, including a server that trickles bytes
    max_bytes: int = 16 * 1024 * 1024
    max_redirects: int = 3


# -- what the judge says ---------------------------------------------------------------------------------


class State(StrEnum):
    STARTING = "starting"
    IDLE = "idle"
    WORKING = "working"
    SUSPECT = "suspect"
    FROZEN = "frozen"
    DOWN = "down"
    BLIND = "blind"


CALM = frozenset({State.IDLE, State.WORKING})  # the states with nothing to act on and nothing to look closer at


def calm(verdicts: Iterable[Verdict]) -> bool:
    """Every engine idle or working, and at least one seen: nothing to act on, look closer at or hurry for. Who also
    holds an incident or a recovery adds that to it (the responder, the service's trace and status)."""
    states = [v.state for v in verdicts]
    return bool(states) and all(s in CALM for s in states)


# -- observations: what the judge is fed, each stamped with the judge's clock ---------------------------


@dataclass(frozen=True, slots=True)
class ProbeStarted:
    t: float
    probe_id: int


@dataclass(frozen=True, slots=True)
class ProbeFinished:
    t: float
    probe_id: int
    ok: bool
    answered: bool  # False: no response before the deadline (or connection lost)
    detail: str = ""


class Decision(StrEnum):
    """What the stacks of every rank say about a suspicion: the one contract between evidence, judge and incident."""

    STUCK = "stuck"  # every rank parked and nothing moved: confirm the freeze now
    WORKING = "working"  # a rank inside the model, a kernel, the sampler or a compile: a long step
    IDLE = "idle"  # EngineCore waits for requests and the page shows none: a healthy idle engine, nothing to confirm
    UNDECIDED = "undecided"  # the stacks could not be read well enough: the metric window decides, and says so


@dataclass(frozen=True, slots=True)
class StackEvidence:
    """The stacks' reading of a suspicion, fed to the judge.

    ``t`` is when the reading arrived; ``captured_at`` when the stacks were taken. Evidence taken before the
    engine's current state began, or before its last progress, says nothing about now and is ignored. Left at 0,
    ``captured_at`` means ``t``.
    """

    t: float
    engine: str
    decision: Decision
    reason: str
    captured_at: float = 0.0

    @property
    def taken(self) -> float:
        return self.captured_at or self.t


@dataclass(frozen=True, slots=True)
class ServerProcess:
    """What the process table said while the port was closed: a server process for it, and since when."""

    t: float
    pid: int | None  # None: no server process for the port
    started_wall: float = 0.0
    titles: tuple[str, ...] = ()


Observation = Scrape | ProbeStarted | ProbeFinished | StackEvidence | ServerProcess


@dataclass(frozen=True, slots=True)
class Verdict:
    engine: str
    state: State
    reason: str
    since: float
    t: float
    stalled_for: float = 0.0
    incarnation: int = 1
    model: str = ""
    last_progress: float | None = None
    # WORKING only because the stacks explained a long step (nothing moved on the page): never proof of recovery
    stacks_only: bool = False


@dataclass(frozen=True, slots=True)
class Transition:
    t: float
    engine: str
    from_state: State | None
    to_state: State
    reason: str


# -- one identity per incident --------------------------------------------------------------------------


def iso(wall: float) -> str:
    """Wall time as every file and payload of the watchdog writes it: ISO 8601 UTC, milliseconds, ``Z``."""
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def incident_id(wall: float, stack: str, engine: str, kind: str, nonce: str) -> str:
    """The one id of an incident: its bundle directory, every event, every alert, ``status`` and ``show``.

    Sortable by time and readable at 3 a.m.; ``nonce`` (a few random hex digits from the caller) keeps two
    incidents of the same second apart.
    """
    stamp = datetime.fromtimestamp(wall, UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{stack}-engine{engine}-{kind}-{nonce}"
