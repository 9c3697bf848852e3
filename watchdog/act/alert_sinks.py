"""What an alert is and how each kind of receiver gets it: the webhook, Slack and Alertmanager wire formats.

Generic webhook body (``WebhookSink``), JSON, UTF-8, ``Content-Type: application/json``::

    {"version": 1,                    # schema version, an integer
     "event": "stall_detected",       # stall_detected | evidence_captured | restart_started | recovered |
                                      # restart_failed | gave_up | engine_down | blind | blind_frozen |
                                      # watchdog_fault | resolved
     "incident_id": "...", "engine": "...", "stack": "...",
     "url": "http://host:8000",       # the engine's base URL
     "state": "frozen",               # the engine's state when the event happened
     "summary": "one human line",
     "details": {...},                # event-specific: verdict, bundle, downtime, error, kind...
     "time": "2025-01-31T12:00:00.123Z",  # ISO 8601 UTC, when the event happened
     "resolved": false}

When a secret is set, ``X-Watchdog-Signature: sha256=<hex HMAC-SHA256(secret, exact body bytes)>`` and
``X-Watchdog-Timestamp: <unix seconds at sending>`` are added (see `verify_signature`). A timed-out attempt may
have reached the receiver, so receivers should deduplicate on (incident_id, event).

Alertmanager (``AlertmanagerSink``): one alert per incident, named as the shipped Prometheus rule for the same
trouble (EngineWatchdogEngineFrozen, ...Down, ...StartingTooLong or ...Blind, from ``details["kind"]`` =
frozen/down/boot_timeout/blind, else the incident's first event/state), labels ``engine``, ``stack``, ``host``,
``incident_id``, ``severity``; each event updates its annotations; ``endsAt`` is set when ``resolved``. Without
``firing_ttl`` Alertmanager ends a firing alert after its own ``resolve_timeout``. The shipped Alertmanager config
mutes the rules' alert for an engine while the daemon's own one (it has an ``incident_id``) fires: one page.

Severity: an incident the watchdog is restarting within its budget is ``warning`` (chat, no page); it becomes the
sink's ``severity`` (``critical`` by default: a page) when a restart fails, the budget is spent, or nothing will be
restarted (no steps, dry run, alert-only). Labels are an alert's identity in Alertmanager, so the change ends the
warning alert and fires the page in one post.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests

from watchdog import __version__
from watchdog.config.load import Secret
from watchdog.core.types import iso

EVENTS = ("stall_detected", "evidence_captured", "restart_started", "recovered", "restart_failed", "gave_up",
          "engine_down", "blind", "blind_frozen", "watchdog_fault", "resolved")
SEVERITIES = ("critical", "warning")
_USER_AGENT = f"engine-watchdog/{__version__}"  # receivers can tell which watchdog sent an alert


@dataclass(frozen=True, slots=True)
class Alert:
    event: str
    incident_id: str
    engine: str
    stack: str
    url: str
    state: str
    summary: str
    details: Mapping[str, object] = field(default_factory=dict)
    time: float = field(default_factory=time.time)  # wall clock
    resolved: bool = False
    runbook: str = ""  # where the page for this cause is read (core/runbooks.runbook_link), "" for none
    severity: str = "critical"  # "warning" while the watchdog is restarting it within its budget: no page

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown alert event {self.event!r} (known: {', '.join(EVENTS)})")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown alert severity {self.severity!r} (known: {', '.join(SEVERITIES)})")


class Sink(Protocol):
    name: str

    def send(self, alert: Alert) -> None: ...


class DeliveryError(Exception):
    """The receiver answered, but not with a 2xx."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def sign(secret: Secret, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.reveal().encode(), body, hashlib.sha256).hexdigest()


def verify_signature(secret: Secret, body: bytes, header: str) -> bool:
    return hmac.compare_digest(sign(secret, body), header)


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str).encode()


class _HttpSink:
    """POSTs `body(alert)` through a session of its own (each sink is used by one worker thread)."""

    kind = "http"

    def __init__(self, url: str, *, name: str | None = None, connect_timeout: float = 3.0,
                 read_timeout: float = 10.0) -> None:
        self.name = name or self.kind
        self._url, self.timeout = url, (connect_timeout, read_timeout)
        self.session = requests.Session()
        self.session.headers["User-Agent"] = _USER_AGENT

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"  # never the URL: it may hold a token

    def body(self, alert: Alert) -> bytes:
        raise NotImplementedError

    def headers(self, body: bytes) -> dict[str, str]:
        return {}

    def send(self, alert: Alert) -> None:
        body = self.body(alert)
        with self.session.post(self._url, data=body, headers={"Content-Type": "application/json", **self.headers(body)},
                               timeout=self.timeout, allow_redirects=False, stream=True) as r:
            if not 200 <= r.status_code < 300:
                raise DeliveryError(r.status_code)


class WebhookSink(_HttpSink):
    kind = "webhook"

    def __init__(self, url: str, secret: Secret | None = None, **kw: Any) -> None:
        super().__init__(url, **kw)
        self._secret = secret

    def body(self, alert: Alert) -> bytes:
        return _json({"version": 1, "event": alert.event, "incident_id": alert.incident_id, "engine": alert.engine,
                      "stack": alert.stack, "url": alert.url, "state": alert.state, "summary": alert.summary,
                      "details": dict(alert.details), "time": iso(alert.time), "resolved": alert.resolved,
                      "runbook": alert.runbook, "severity": alert.severity})

    def headers(self, body: bytes) -> dict[str, str]:
        if not self._secret:
            return {}
        return {"X-Watchdog-Signature": sign(self._secret, body), "X-Watchdog-Timestamp": str(int(time.time()))}


def headline(alert: Alert) -> str:
    return (f"[{'RESOLVED' if alert.resolved else alert.event}] {alert.stack} engine {alert.engine}: "
            f"{alert.summary} (state {alert.state}, incident {alert.incident_id})")


def _facts(alert: Alert) -> list[str]:
    facts = [f"{k}={v}" for k, v in alert.details.items() if v not in (None, "")]
    return [*facts, f"runbook={alert.runbook}"] if alert.runbook else facts


class SlackSink(_HttpSink):
    kind = "slack"

    def body(self, alert: Alert) -> bytes:
        icon = ":white_check_mark:" if alert.resolved else ":rotating_light:"
        context = " · ".join([alert.url, iso(alert.time), *_facts(alert)])[:2900]
        return _json({"text": headline(alert), "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"{icon} {headline(alert)}"}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]}]})


# blind: the watchdog cannot see the page or a node (docs/blind.md)
_ALERTNAMES = {"frozen": "EngineWatchdogEngineFrozen", "down": "EngineWatchdogEngineDown",
               "boot_timeout": "EngineWatchdogEngineStartingTooLong", "blind": "EngineWatchdogEngineBlind"}


class AlertmanagerSink(_HttpSink):
    kind = "alertmanager"

    def __init__(self, base_url: str, *, severity: str = "critical", firing_ttl: float | None = None,
                 host: str | None = None, **kw: Any) -> None:
        super().__init__(base_url.rstrip("/") + "/api/v2/alerts", **kw)
        self.severity, self.firing_ttl = severity, firing_ttl
        self.host = socket.gethostname() if host is None else host  # the rules' alerts get it from watchdog_info
        self._kinds: OrderedDict[str, str] = OrderedDict()  # incident -> kind: one incident is one alert
        self._sent: dict[str, str] = {}  # incident -> the severity label last sent for it

    def alertname(self, alert: Alert) -> str:
        kind = alert.details.get("kind")
        if not isinstance(kind, str) or kind not in _ALERTNAMES:
            kind = self._kinds.get(alert.incident_id) or (
                "down" if alert.event == "engine_down" or alert.state == "down" else
                "blind" if alert.event in ("blind", "blind_frozen") or alert.state == "blind" else "frozen")
        self._kinds[alert.incident_id] = kind
        if len(self._kinds) > 1024:
            gone, _ = self._kinds.popitem(last=False)
            self._sent.pop(gone, None)
        return _ALERTNAMES[kind]

    def severity_of(self, alert: Alert) -> str:
        """The severity label: the sink's own for a page, "warning" while the watchdog has it in hand. A resolve ends
        the alert that was sent (labels are its identity), whatever the resolving event says."""
        if alert.resolved and alert.incident_id in self._sent:
            return self._sent[alert.incident_id]
        return self.severity if alert.severity == "critical" else "warning"

    def body(self, alert: Alert) -> bytes:
        severity, before = self.severity_of(alert), self._sent.get(alert.incident_id)
        labels = {"alertname": self.alertname(alert), "engine": alert.engine, "stack": alert.stack,
                  "host": self.host, "incident_id": alert.incident_id}
        annotations = {"summary": headline(alert), "event": alert.event,
                       "description": "; ".join([f"{alert.event}: {alert.summary}", *_facts(alert)])}
        if alert.details.get("bundle"):
            annotations["bundle"] = str(alert.details["bundle"])
        if alert.runbook:
            annotations["runbook_url"] = alert.runbook  # the annotation name Prometheus' own rules use
        am: dict[str, Any] = {"labels": {k: v for k, v in {**labels, "severity": severity}.items() if v},
                              "annotations": annotations, "startsAt": iso(alert.time), "generatorURL": alert.url}
        if alert.resolved or self.firing_ttl:
            am["endsAt"] = iso(alert.time + (0 if alert.resolved else self.firing_ttl or 0))
        posts = [am]
        if before is not None and before != severity:  # escalated: the warning ends as the page fires
            posts.insert(0, {**am, "labels": {**am["labels"], "severity": before}, "endsAt": iso(alert.time)})
        return _json(posts)

    def send(self, alert: Alert) -> None:
        super().send(alert)  # delivered: from now on Alertmanager holds this severity's alert for the incident
        if alert.resolved:
            self._sent.pop(alert.incident_id, None)
        else:
            self._sent[alert.incident_id] = self.severity_of(alert)
