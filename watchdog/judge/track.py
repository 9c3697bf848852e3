"""What the judge keeps between observations: its thresholds, one track per engine, the probe's last round.
Pure data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from watchdog.core.types import ProbeStarted, StackEvidence, Verdict


@dataclass(frozen=True, slots=True)
class Thresholds:
    suspect_after: float = 5.0
    stall_window: float = 40.0
    probe_interval: float = 30.0  # 0 disables probes
    probe_retry: float = 5.0  # while starting, how often to try to prove the engine serves
    recheck_max: float = 240.0  # a long step the stacks explained is checked again after 5, 10, 20 ... s, at most this
    kv_epsilon: float = 1e-12


@dataclass(slots=True)
class Track:
    """What the judge remembers of one engine between observations."""

    engine: str
    model: str = ""
    counters: dict[str, float] | None = None
    kv: float | None = None
    running: float = 0.0
    waiting: float = 0.0
    last_progress: float | None = None
    pending_since: float | None = None
    confirmed: StackEvidence | None = None
    explained: StackEvidence | None = None  # the stacks showed this stall to be a long step
    checks: int = 0  # stack checks that explained this stall
    retries: int = 0  # stack checks that could not decide this suspicion (each looked at again, later)
    next_check: float | None = None  # when to look at the stacks again (an explained stall, an undecided suspicion)
    undecided: str = ""  # why the stacks could not decide during this stall
    ready: bool = False
    served: bool = False  # its serving counters were above 0 when first seen: it served before this watch began
    incarnation: int = 1
    verdict: Verdict | None = None

    @property
    def stall_start(self) -> float | None:
        """When the stall began: the later of work pending and the last progress; None while nothing is pending."""
        if self.pending_since is None:
            return None
        return max(self.pending_since, self.last_progress or self.pending_since)

    def forget_incarnation(self) -> None:
        """The engine went away: what comes back is a new incarnation that must prove itself again."""
        if self.counters is not None or self.ready:
            self.incarnation += 1
        self.counters, self.kv, self.ready, self.served = None, None, False, False
        self.last_progress = self.pending_since = None
        self.forget_stacks()
        self.running = self.waiting = 0.0

    def forget_stacks(self) -> None:
        self.confirmed = self.explained = None
        self.checks, self.retries, self.next_check, self.undecided = 0, 0, None, ""


@dataclass(slots=True)
class ProbeTrack:
    """The generation probe's last round, shared by every engine of the server."""

    in_flight: ProbeStarted | None = None
    last_started: float | None = None
    stuck_since: float | None = None  # a probe got no answer and nothing has served since
    last_error: str = ""
