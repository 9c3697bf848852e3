"""The alert delivery log (``STATE_DIR/alerts.jsonl``): what became of each alert at each sink, one line each:
``delivered`` (the sink answered 2xx), ``failed`` (given up after its retries, with the last error), ``dropped``
(its queue was full, or the watchdog was closing).

It is the notification log of the kind Alertmanager keeps: a watchdog started again (after a crash, an OOM kill,
an upgrade) reads it and sends no alert that was delivered or given up on in its last life. Rolled over past
``state.events_max_bytes`` like the event log; a full disk loses lines, never the alert.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from watchdog.act.alert_sinks import Alert
from watchdog.core.types import iso
from watchdog.host.jsonl_log import JsonLinesLog, generations

OUTCOMES = ("delivered", "failed", "dropped")
SETTLED = ("delivered", "failed")  # an alert not to send again

Key = tuple[str, str, str]  # (incident id, alert event, sink name)


class DeliveryLog:
    def __init__(self, path: Path, max_bytes: int = 0) -> None:
        self.path = path
        self._log = JsonLinesLog(path, max_bytes)
        self._log.what = "alert deliveries"
        self._lock = threading.Lock()  # one thread per sink writes

    def record(self, alert: Alert, sink: str, outcome: str, attempts: int = 0, error: str = "",
               wall: float | None = None) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown delivery outcome {outcome!r}")
        rec: dict[str, object] = {"time": iso(time.time() if wall is None else wall), "incident": alert.incident_id,
                                  "event": alert.event, "sink": sink, "outcome": outcome, "attempts": attempts}
        if error:
            rec["error"] = error
        with self._lock:
            self._log.write(rec)

    def settled(self) -> set[Key]:
        """The (incident, event, sink) delivered or given up on, as far back as the log's two generations go."""
        return settled(self.path)

    def close(self) -> None:
        with self._lock:
            self._log.close()


def settled(path: Path) -> set[Key]:
    out: set[Key] = set()
    for p in generations(path):
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line torn by a kill
                continue
            if isinstance(rec, dict) and rec.get("outcome") in SETTLED:
                out.add((str(rec.get("incident")), str(rec.get("event")), str(rec.get("sink"))))
    return out
