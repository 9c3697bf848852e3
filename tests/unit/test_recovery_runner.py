"""RecoveryRunner: the proof's wait is on the monotonic clock; a step of the wall clock neither ends it nor stretches
it (a fake clock, a generation that never answers)."""

from __future__ import annotations

from watchdog.act.incident_types import RecoveryJob
from watchdog.act.restart import RecoveryRunner

W0 = 1_800_000_000.0


class Clocks:
    """Each try moves the monotonic clock by a second; the wall clock steps ``jump`` at the first try."""

    def __init__(self, jump: float) -> None:
        self.mono, self.wall, self.jump, self.tries = 0.0, W0, jump, 0

    def generate(self) -> tuple[bool, bool, str]:
        self.tries += 1
        self.mono += 1.0
        self.wall += 1.0 + (self.jump if self.tries == 1 else 0.0)
        return False, False, "connection refused"


def prove(jump: float, timeout: float = 5.0) -> tuple[Clocks, str]:
    c = Clocks(jump)
    runner = RecoveryRunner(None, c.generate, retry=0.001, wall=lambda: c.wall, clock=lambda: c.mono)
    runner.start(RecoveryJob("i-1", False, timeout))
    assert runner._thread is not None
    runner._thread.join(10)
    done = runner.poll()
    assert done is not None and not done.ok and done.stage == "ready"
    return c, done.detail


def test_the_wall_clock_stepped_on_an_hour_does_not_end_the_wait() -> None:
    c, detail = prove(3600.0)
    assert c.tries == 5 and "boot timeout" in detail


def test_the_wall_clock_stepped_back_an_hour_does_not_stretch_it() -> None:
    c, _ = prove(-3600.0)
    assert c.tries == 5


def test_a_job_with_nothing_left_tries_once() -> None:
    c, _ = prove(0.0, timeout=0.0)
    assert c.tries == 1
