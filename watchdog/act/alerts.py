"""Alerts: tell people (and Alertmanager) what the watchdog saw and did, without ever slowing it down.

`Dispatcher.submit` returns at once; one worker thread per sink delivers from a bounded queue, retrying with
exponential backoff (tenacity), bounded in attempts and total time, then logs one line and gives up. Each
(incident_id, event, sink) is sent at most once. Logs name sinks, never their URLs, tokens or secrets.

Generic webhook body (``WebhookSink``), JSON, UTF-8, ``Content-Type: application/json``::

    {"version": 1,                    # schema version, an integer
     "event": "stall_detected",       # stall_detected | evidence_captured | restart_started | recovered |
                                      # restart_failed | gave_up | engine_down | resolved
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

Alertmanager (``AlertmanagerSink``): one alert per incident, labels ``alertname`` (EngineFrozen, EngineDown or
EngineBootTimeout from ``details["kind"]`` = frozen/down/boot_timeout, else the incident's first event/state),
``engine``, ``stack``, ``incident_id``, ``severity``; each event updates its annotations; ``endsAt`` is set
when ``resolved``. Without ``firing_ttl`` Alertmanager ends a firing alert after its own ``resolve_timeout``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests
import tenacity

from watchdog import __version__
from watchdog.act.state import iso
from watchdog.config.load import Config, Secret

log = logging.getLogger(__name__)

EVENTS = ("stall_detected", "evidence_captured", "restart_started", "recovered", "restart_failed", "gave_up",
          "engine_down", "watchdog_fault", "resolved")
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

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown alert event {self.event!r} (known: {', '.join(EVENTS)})")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 5
    wait_initial: float = 1.0  # seconds before the 2nd attempt, doubling after
    wait_max: float = 30.0
    total: float = 120.0  # no new attempt after this many seconds
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1 or min(self.wait_initial, self.wait_max, self.total, self.jitter) < 0:
            raise ValueError(f"invalid retry policy {self!r}")

    @classmethod
    def instant(cls, attempts: int = 3) -> RetryPolicy:
        """For tests: the same bounded attempts, no waiting between them."""
        return cls(attempts=attempts, wait_initial=0.0, wait_max=0.0, total=3600.0, jitter=0.0)


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
                      "details": dict(alert.details), "time": iso(alert.time), "resolved": alert.resolved})

    def headers(self, body: bytes) -> dict[str, str]:
        if not self._secret:
            return {}
        return {"X-Watchdog-Signature": sign(self._secret, body), "X-Watchdog-Timestamp": str(int(time.time()))}


def headline(alert: Alert) -> str:
    return (f"[{'RESOLVED' if alert.resolved else alert.event}] {alert.stack} engine {alert.engine}: "
            f"{alert.summary} (state {alert.state}, incident {alert.incident_id})")


def _facts(alert: Alert) -> list[str]:
    return [f"{k}={v}" for k, v in alert.details.items() if v not in (None, "")]


class SlackSink(_HttpSink):
    kind = "slack"

    def body(self, alert: Alert) -> bytes:
        icon = ":white_check_mark:" if alert.resolved else ":rotating_light:"
        context = " · ".join([alert.url, iso(alert.time), *_facts(alert)])[:2900]
        return _json({"text": headline(alert), "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"{icon} {headline(alert)}"}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]}]})


_ALERTNAMES = {"frozen": "EngineFrozen", "down": "EngineDown", "boot_timeout": "EngineBootTimeout"}


class AlertmanagerSink(_HttpSink):
    kind = "alertmanager"

    def __init__(self, base_url: str, *, severity: str = "critical", firing_ttl: float | None = None,
                 **kw: Any) -> None:
        super().__init__(base_url.rstrip("/") + "/api/v2/alerts", **kw)
        self.severity, self.firing_ttl = severity, firing_ttl
        self._kinds: OrderedDict[str, str] = OrderedDict()  # incident -> kind: one incident is one alert

    def alertname(self, alert: Alert) -> str:
        kind = alert.details.get("kind")
        if not isinstance(kind, str) or kind not in _ALERTNAMES:
            kind = self._kinds.get(alert.incident_id) or (
                "down" if alert.event == "engine_down" or alert.state == "down" else "frozen")
        self._kinds[alert.incident_id] = kind
        if len(self._kinds) > 1024:
            self._kinds.popitem(last=False)
        return _ALERTNAMES[kind]

    def body(self, alert: Alert) -> bytes:
        labels = {"alertname": self.alertname(alert), "engine": alert.engine, "stack": alert.stack,
                  "incident_id": alert.incident_id, "severity": self.severity}
        annotations = {"summary": headline(alert), "event": alert.event,
                       "description": "; ".join([f"{alert.event}: {alert.summary}", *_facts(alert)])}
        if alert.details.get("bundle"):
            annotations["bundle"] = str(alert.details["bundle"])
        am: dict[str, Any] = {"labels": {k: v for k, v in labels.items() if v}, "annotations": annotations,
                              "startsAt": iso(alert.time), "generatorURL": alert.url}
        if alert.resolved or self.firing_ttl:
            am["endsAt"] = iso(alert.time + (0 if alert.resolved else self.firing_ttl or 0))
        return _json([am])


_KINDS = ((requests.ConnectTimeout, "connect timeout"), (requests.Timeout, "read timeout"),
          (requests.ConnectionError, "connection failed"))


def describe_error(exc: BaseException) -> str:
    """A loggable account of a failure: never str() of a requests error, which holds the URL."""
    if isinstance(exc, DeliveryError):
        return str(exc)
    kind = next((k for t, k in _KINDS if isinstance(exc, t)), type(exc).__name__)
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:  # the OS reason (e.g. "Connection refused") buried in requests' and urllib3's wrappers
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and isinstance(e.strerror, str):
            return f"{kind} ({e.strerror})"
        todo += [*e.args, getattr(e, "reason", None), e.__cause__, e.__context__]
    return kind


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, DeliveryError):
        return exc.status >= 500 or exc.status in (408, 425, 429)
    return isinstance(exc, requests.ConnectionError | requests.Timeout | requests.exceptions.ChunkedEncodingError)


class _Worker:
    def __init__(self, sink: Sink, retry: RetryPolicy, queue_size: int, abort: threading.Event) -> None:
        self.sink, self.retry, self.abort = sink, retry, abort
        self.queue: queue.Queue[Alert] = queue.Queue(queue_size)
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"alerts-{sink.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                alert = self.queue.get(timeout=0.2)
            except queue.Empty:
                if self.closing.is_set():
                    return
                continue
            try:
                if self.abort.is_set():
                    log.warning("alert sink %s: closing, dropped %s for incident %s", self.sink.name, alert.event,
                                alert.incident_id)
                else:
                    self._deliver(alert)
            finally:
                self.queue.task_done()

    def _sleep(self, seconds: float) -> None:
        self.abort.wait(seconds)  # close() cuts a backoff short

    def _deliver(self, alert: Alert) -> None:
        attempts, started = 0, time.monotonic()

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            self.sink.send(alert)

        def before_sleep(rs: tenacity.RetryCallState) -> None:
            err = rs.outcome.exception() if rs.outcome else None
            log.debug("alert sink %s: %s for incident %s failed (attempt %d: %s), retrying in %.1fs",
                      self.sink.name, alert.event, alert.incident_id, rs.attempt_number,
                      describe_error(err) if err else "?", rs.upcoming_sleep)

        p = self.retry
        retrying = tenacity.Retrying(
            stop=tenacity.stop_any(tenacity.stop_after_attempt(p.attempts), tenacity.stop_after_delay(p.total),
                                   tenacity.stop_when_event_set(self.abort)),
            wait=tenacity.wait_exponential(multiplier=p.wait_initial, max=p.wait_max)
            + tenacity.wait_random(0, p.jitter),
            retry=tenacity.retry_if_exception(_retryable), sleep=self._sleep, before_sleep=before_sleep,
            reraise=True)
        try:
            retrying(attempt)
        except Exception as e:
            log.warning("alert not delivered, giving up: sink %s, event %s, incident %s, engine %s: %s "
                        "(%d attempt%s in %.1fs)", self.sink.name, alert.event, alert.incident_id, alert.engine,
                        describe_error(e), attempts, "" if attempts == 1 else "s", time.monotonic() - started)
        else:
            log.debug("alert sink %s: delivered %s for incident %s (attempt %d)", self.sink.name, alert.event,
                      alert.incident_id, attempts)


class Dispatcher:
    """Sends each alert to every sink in the background; `submit` never blocks."""

    def __init__(self, sinks: Sequence[Sink], retry: RetryPolicy | None = None, *, queue_size: int = 256,
                 dedup_size: int = 4096) -> None:
        names = [s.name for s in sinks]
        if len(set(names)) != len(names):
            raise ValueError(f"alert sink names must be unique, got {names}")
        self._abort = threading.Event()
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._dedup_size = dedup_size
        self._closed = False
        self._workers = [_Worker(s, retry or RetryPolicy(), queue_size, self._abort) for s in sinks]

    def submit(self, alert: Alert) -> None:
        with self._lock:
            if self._closed:
                log.warning("alerts closed: dropped %s for incident %s", alert.event, alert.incident_id)
                return
            for w in self._workers:
                key = (alert.incident_id, alert.event, w.sink.name)
                if key in self._seen:
                    log.debug("alert sink %s: %s for incident %s already sent", w.sink.name, alert.event,
                              alert.incident_id)
                    continue
                try:
                    w.queue.put_nowait(alert)
                except queue.Full:
                    log.warning("alert sink %s: queue full, dropped %s for incident %s", w.sink.name, alert.event,
                                alert.incident_id)
                    continue
                self._seen[key] = None
                while len(self._seen) > self._dedup_size:
                    self._seen.popitem(last=False)

    def wait_idle(self, timeout: float) -> bool:
        """True once every queued alert has been delivered or given up on (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while any(w.queue.unfinished_tasks for w in self._workers):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Deliver what is queued within `timeout`, then drop the rest and stop; True if all stopped in time."""
        with self._lock:
            self._closed = True
        drained = self.wait_idle(timeout)
        if not drained:
            self._abort.set()
        for w in self._workers:
            w.closing.set()
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
        return drained and not any(w.thread.is_alive() for w in self._workers)



def build_dispatcher(cfg: Config) -> Dispatcher | None:
    """The configured sinks, their URLs and secrets read now (a missing one is a ConfigError); None if none."""
    sinks: list[Sink] = []
    for i, s in enumerate(cfg.alerts.sinks):
        key = f"alerts.sinks[{i}]"
        url = s.url or cfg.secret(f"{key}.url", s.url_env, s.url_file).reveal()
        kw: dict[str, Any] = {"name": s.name or s.kind, "read_timeout": s.timeout}
        if s.kind == "webhook":
            secret = cfg.secret(f"{key}.secret", s.secret_env, s.secret_file)
            sinks.append(WebhookSink(url, secret or None, **kw))
        elif s.kind == "slack":
            sinks.append(SlackSink(url, **kw))
        else:
            sinks.append(AlertmanagerSink(url, severity=s.severity, firing_ttl=s.firing_ttl or None, **kw))
    if not sinks:
        return None
    return Dispatcher(sinks, RetryPolicy(attempts=cfg.alerts.attempts, total=cfg.alerts.retry_for))
