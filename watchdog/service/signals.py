"""SIGTERM and SIGINT through a self-pipe: the daemon's sleep between passes ends at once when either comes.

The handler only records the signal; `StopSignals.sleep` waits on the pipe (Python writes a byte to it for every
signal), so a stop never waits for the rest of an interval.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from types import FrameType
from typing import Any, Protocol


class Pinger(Protocol):
    """The part of the notifier the sleep needs: systemd's watchdog ping, sent from the loop's own thread."""

    def ping_due_in(self) -> float | None: ...

    def ping_if_due(self) -> object: ...


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None  # the stop signal, once one came
        self._r, self._w = -1, -1
        self._old_wakeup = -1
        self._old_handlers: dict[int, Any] = {}

    def install(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._w)
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum

    def restore(self) -> None:
        for s, handler in self._old_handlers.items():
            signal.signal(s, handler)
        self._old_handlers = {}
        if self._w >= 0:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._r)
            os.close(self._w)
            self._r = self._w = -1

    def sleep(self, seconds: float, pinger: Pinger) -> None:
        """Until ``seconds`` have passed or a stop signal came; wakes up on the way for systemd's watchdog ping when
        it is due (from this thread: a loop that wedges stops pinging)."""
        deadline = time.monotonic() + seconds
        while self.received is None and (left := deadline - time.monotonic()) > 0:
            due = pinger.ping_due_in()
            wait = left if due is None else min(left, due)
            if self._r < 0:  # not installed (a test, or after restore): a plain sleep
                time.sleep(wait)
            elif select.select([self._r], [], [], wait)[0]:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._r, 512)
            pinger.ping_if_due()
