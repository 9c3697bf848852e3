"""The restart policy: pure decisions over what is known now. No I/O, no clock: time arrives as data.

``choose`` answers one question for an open incident: restart now, wait, hold, give up, or only watch, and why.
``in_hand`` says whether that answer leaves the incident to the watchdog (its alerts a warning, no page).
The restart budget (at most ``budget`` restarts per ``window`` seconds) and the backoff between restarts
(``backoff_initial`` before the 2nd restart in the window, doubling, at most ``backoff_max``) are computed from the
wall times of the restarts issued, which the daemon keeps on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from watchdog.act.incident_types import Kind
from watchdog.config.act import RestartSection


class Choice(StrEnum):
    RESTART = "restart"
    WAIT = "wait"  # backoff: not yet
    HOLD = "hold"  # the stacks show the engine working
    GIVE_UP = "give_up"  # budget spent: a human is needed
    AWAIT_SUPERVISOR = "await_supervisor"  # the stack's supervisor restarts it; watch for ready
    OBSERVE = "observe"  # nothing to do by configuration, or after giving up
    PAUSED = "paused"
    DRY_RUN = "dry_run"


@dataclass(frozen=True, slots=True)
class Ruling:
    choice: Choice
    reason: str
    not_before: float | None = None  # WAIT: the wall time the next restart is allowed


@dataclass(frozen=True, slots=True)
class Budget:
    budget: int = 3
    window: float = 3600.0
    backoff_initial: float = 60.0
    backoff_max: float = 900.0

    @classmethod
    def of(cls, section: RestartSection) -> Budget:
        return cls(section.budget, section.budget_window, section.backoff_initial, section.backoff_max)

    def recent(self, restarts: Sequence[float], now: float, reset_at: float = 0.0) -> list[float]:
        return sorted(t for t in restarts if now - t < self.window and t >= reset_at)

    def left(self, restarts: Sequence[float], now: float, reset_at: float = 0.0) -> int:
        return max(0, self.budget - len(self.recent(restarts, now, reset_at)))

    def backoff(self, issued: int) -> float:
        """Seconds to wait after the last restart when ``issued`` restarts are already in the window."""
        if issued <= 0 or self.backoff_initial <= 0:
            return 0.0
        try:
            return min(self.backoff_initial * 2.0 ** (issued - 1), self.backoff_max)
        except OverflowError:  # 2.0 ** 1024 and beyond: far past any maximum
            return self.backoff_max

    def next_allowed(self, restarts: Sequence[float], now: float, reset_at: float = 0.0) -> float:
        recent = self.recent(restarts, now, reset_at)
        return recent[-1] + self.backoff(len(recent)) if recent else now


def choose(kind: Kind, *, budget: Budget, restarts: Sequence[float], now: float, reset_at: float = 0.0,
           stacks_working: bool = False, paused: bool = False, dry_run: bool = False, gave_up: bool = False,
           has_steps: bool = True, supervised: bool = False, on_boot_timeout: bool = True) -> Ruling:
    """What to do about an open incident of ``kind`` (frozen, down or boot_timeout), confirmed still bad now."""
    if paused:
        return Ruling(Choice.PAUSED, "paused for maintenance: no action (`watchdog resume` ends it)")
    if gave_up:
        return Ruling(Choice.OBSERVE, "gave up earlier: observe only until `watchdog reset`")
    if kind == Kind.FROZEN and stacks_working:
        return Ruling(Choice.HOLD, "the stacks show the engine working (moving between captures): holding")
    if kind == Kind.DOWN and supervised:
        return Ruling(Choice.AWAIT_SUPERVISOR, "the stack's supervisor restarts it: waiting for it to serve")
    if kind == Kind.BOOT_TIMEOUT and not on_boot_timeout:
        return Ruling(Choice.OBSERVE, "restart.on_boot_timeout is off: alert only")
    if not has_steps:
        return Ruling(Choice.OBSERVE, "no restart steps configured: alert only")
    if dry_run:
        return Ruling(Choice.DRY_RUN, "dry run: the restart is described, not run")
    if budget.left(restarts, now, reset_at) <= 0:
        return Ruling(Choice.GIVE_UP, f"restart budget spent ({budget.budget} in {budget.window:g}s): "
                        "a human is needed")
    not_before = budget.next_allowed(restarts, now, reset_at)
    if now < not_before:
        return Ruling(Choice.WAIT, f"backoff: next restart allowed in {not_before - now:.0f}s", not_before)
    return Ruling(Choice.RESTART, f"restarting ({budget.left(restarts, now, reset_at)} of {budget.budget} "
                    f"left in the budget window)")


IN_HAND = frozenset({Choice.RESTART, Choice.WAIT, Choice.HOLD, Choice.AWAIT_SUPERVISOR})


def in_hand(choice: Choice) -> bool:
    """The watchdog (or the stack's supervisor) will restart it within the budget: nobody needs paging yet. Holding
    counts: the stacks show work, and the restart follows at ``hold_max`` if progress does not. Paused, alert-only,
    dry run and a spent budget need a human."""
    return choice in IN_HAND
