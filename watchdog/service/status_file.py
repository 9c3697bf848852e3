"""``status.json``: what `watchdog status` shows, written by the service at a cadence that costs little.

Rewritten when something an operator would see changed, and every few seconds while an engine is in trouble (its
reason counts seconds); while every engine is idle or working, every half minute (their reasons hold counts), its
mtime moving every ten seconds meanwhile so that a reader can tell a live service from a dead one. The reader
counts durations from the wall times written (`watchdog.act.state.load_status`). A write that fails is tried whole
again on the next pass; nothing else is lost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.act.state import save_status, touch_status
from watchdog.core.types import Verdict, calm

log = logging.getLogger(__name__)

STATUS_EVERY = 5.0  # seconds between rewrites of an unchanged status.json in trouble
STATUS_CALM_EVERY = 30.0  # seconds between rewrites of an unchanged status.json while every engine is idle or working
# seconds between touches of an unchanged status.json: `watchdog status` calls a status older than 30 s stale (a
# utime costs ~60 us of CPU when cold)
STATUS_TOUCH_EVERY = 10.0


class StatusFile:
    """The service's status.json; ``on_error`` counts a failed write (the exporter's write_errors)."""

    def __init__(self, state_dir: Path, fixed: dict[str, Any], on_error: Callable[[], None] = lambda: None) -> None:
        self.state_dir = state_dir
        self.fixed = fixed  # stack, url, interval: the same all the service's life
        self._on_error = on_error
        self._seen: object = None
        self._written = self._touched = float("-inf")

    def update(self, verdicts: list[Verdict], status: dict[str, Any], deadlines: dict[str, Any] | None,
               now: float, mono: float, wall: float) -> bool:
        """After a pass: ``now`` paces the writes, ``mono`` is the verdicts' clock, ``wall`` the time written.
        True when the file was rewritten."""
        seen = (tuple((v.engine, v.state, v.since) for v in verdicts), repr(status["incident"]), status["paused"],
                status["budget_left"], status["recovery"] and status["recovery"]["phase"],
                deadlines and deadlines.get("warning"),
                tuple((b.get("what"), b.get("incident")) for b in status.get("blind") or ()))  # a blind incident
        if seen == self._seen and now - self._written < (STATUS_CALM_EVERY if calm(verdicts) else STATUS_EVERY):
            if now - self._touched >= STATUS_TOUCH_EVERY:
                self._touched = now
                try:
                    touch_status(self.state_dir)
                except OSError as e:
                    self._seen = ()  # rewrite it whole on the next pass
                    log.warning("cannot touch %s/status.json: %s", self.state_dir, e.strerror)
            return False
        self._seen, self._written, self._touched = seen, now, now
        record = {**status, "pid": os.getpid(), "time": wall, **self.fixed,  # the act stage's dict stays its own
                  "engines": [{"engine": v.engine, "state": v.state.value, "reason": v.reason,
                               "for_seconds": round(mono - v.since, 1), "since": wall - (mono - v.since)}
                              for v in verdicts],
                  "deadlines": deadlines}
        try:
            save_status(self.state_dir, record)
        except OSError as e:
            self._seen = ()  # try it whole again on the next pass
            self._on_error()
            log.warning("cannot write %s/status.json: %s", self.state_dir, e.strerror)
            return False
        return True
