"""The event log (``STATE_DIR/events.jsonl``) and what the daemon says about each transition.

Writing never takes the daemon down: a full or broken disk is counted, logged once per streak and reported to the
daemon (which alerts once); the loop goes on judging and acting, and the log resumes when the disk has room.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import IO

from watchdog.core.types import State, Transition, iso

log = logging.getLogger(__name__)

LOUD = frozenset({State.FROZEN, State.DOWN, State.BLIND, State.SUSPECT})


class EventLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: IO[str] | None = None
        self.failures = 0  # writes lost in the current streak of failures
        self.lost = 0  # writes lost since start

    def write(self, record: dict[str, object]) -> OSError | None:
        """Append one JSON line; returns the error when it could not (the first of a streak is logged)."""
        try:
            if self._f is None:
                self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across writes
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as e:
            self._drop()
            self.failures += 1
            self.lost += 1
            if self.failures == 1:
                log.error("cannot write %s: %s (events are lost until it can; the watch goes on)", self.path,
                          e.strerror or e)
            return e
        if self.failures:
            log.warning("writing %s again after %d lost events", self.path, self.failures)
            self.failures = 0
        return None

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None


def transition_record(stack: str, url: str, tr: Transition, wall: float) -> dict[str, object]:
    return {"time": iso(wall), "event": "transition", "stack": stack, "url": url, "engine": tr.engine,
            "from": tr.from_state.value if tr.from_state else None, "to": tr.to_state.value, "reason": tr.reason}


def log_transition(stack: str, tr: Transition) -> None:
    level = logging.WARNING if tr.to_state in LOUD else logging.INFO
    before = tr.from_state.value if tr.from_state else "unknown"
    log.log(level, "%s engine %s: %s -> %s: %s", stack, tr.engine, before, tr.to_state.value, tr.reason,
            extra={"ENGINE": tr.engine, "STATE": tr.to_state.value, "FROM_STATE": before, "STACK": stack})
