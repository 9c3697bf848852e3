"""The event log (``STATE_DIR/events.jsonl``) and what the daemon says about each transition.

Writing never takes the daemon down: a full or broken disk is counted, logged once per streak and reported to the
daemon (which alerts once); the loop goes on judging and acting, and the log resumes when the disk has room.

Past ``max_bytes`` (``state.events_max_bytes``) the log rolls over to ``events.jsonl.1``, as the trace does: the
two generations hold at most twice that and one line. Readers take both (`generations`).
"""

from __future__ import annotations

import logging

from watchdog.core.types import State, Transition, iso
from watchdog.host.jsonl_log import JsonLinesLog, generations

__all__ = ["LOUD", "EventLog", "generations", "log_transition", "transition_record"]

log = logging.getLogger(__name__)

LOUD = frozenset({State.FROZEN, State.DOWN, State.BLIND, State.SUSPECT})


class EventLog(JsonLinesLog):
    """``events.jsonl``: what the daemon saw and did, for people and for `watchdog evidence`."""

    what = "events"


def transition_record(stack: str, url: str, tr: Transition, wall: float) -> dict[str, object]:
    return {"time": iso(wall), "event": "transition", "stack": stack, "url": url, "engine": tr.engine,
            "from": tr.from_state.value if tr.from_state else None, "to": tr.to_state.value, "reason": tr.reason}


def log_transition(stack: str, tr: Transition) -> None:
    level = logging.WARNING if tr.to_state in LOUD else logging.INFO
    before = tr.from_state.value if tr.from_state else "unknown"
    log.log(level, "%s engine %s: %s -> %s: %s", stack, tr.engine, before, tr.to_state.value, tr.reason,
            extra={"ENGINE": tr.engine, "STATE": tr.to_state.value, "FROM_STATE": before, "STACK": stack})
