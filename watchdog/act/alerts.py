"""Alerts: tell people (and Alertmanager) what the watchdog saw and did, without ever slowing it down.

`Dispatcher.submit` returns at once; one worker thread per sink delivers from a bounded queue, retrying with
exponential backoff (tenacity), bounded in attempts and total time, then logs one line and gives up. Each
(incident_id, event, sink) is sent at most once, across lives too with the delivery log (`alert_log`). Logs name
sinks, never their URLs, tokens or secrets. The alert itself and the receivers' formats are in
`watchdog.act.alert_sinks`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import requests
import tenacity

from watchdog.act.alert_log import DeliveryLog
from watchdog.act.alert_sinks import (
    EVENTS,
    Alert,
    AlertmanagerSink,
    DeliveryError,
    Sink,
    SlackSink,
    WebhookSink,
    verify_signature,
)
from watchdog.config.load import Config
from watchdog.core.types import base_url, incident_id

__all__ = ["EVENTS", "Alert", "AlertSender", "AlertmanagerSink", "Dispatcher", "RetryPolicy", "SlackSink",
           "WebhookSink", "build_dispatcher", "describe_error", "fault_alert", "verify_signature"]

log = logging.getLogger(__name__)


class AlertSender(Protocol):
    """What the act stage needs to send an alert (`Dispatcher`, or a test's fake)."""

    def submit(self, alert: Alert) -> None: ...


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
    """One sink's thread: it sleeps in the queue until an alert comes, or None to stop (no polling: a watchdog with a
    webhook configured must not wake up five times a second for nothing)."""

    def __init__(self, sink: Sink, retry: RetryPolicy, queue_size: int, abort: threading.Event,
                 ledger: DeliveryLog | None = None) -> None:
        self.sink, self.retry, self.abort, self.ledger = sink, retry, abort, ledger
        self.limit = queue_size  # alerts waiting at most (kept by `Dispatcher.submit`); the stop always fits
        self.delivering = True  # the last alert reached the sink (or none was sent yet); False after a give-up
        self.queue: queue.Queue[Alert | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"alerts-{sink.name}", daemon=True)
        self.thread.start()

    def offer(self, alert: Alert) -> bool:
        """Queue an alert unless ``limit`` are already waiting (then it is dropped: a submit never blocks)."""
        if self.queue.qsize() >= self.limit:
            return False
        self.queue.put_nowait(alert)
        return True

    def stop(self) -> None:
        """Wake the thread to end, after what is queued (dropped unless delivered in time: see abort)."""
        self.queue.put_nowait(None)

    def _run(self) -> None:
        while (alert := self.queue.get()) is not None:
            try:
                if self.abort.is_set():
                    log.warning("alert sink %s: closing, dropped %s for incident %s", self.sink.name, alert.event,
                                alert.incident_id)
                    self.outcome(alert, "dropped", 0, "the watchdog was closing")
                else:
                    self._deliver(alert)
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def outcome(self, alert: Alert, outcome: str, attempts: int, error: str = "") -> None:
        if self.ledger is not None:
            self.ledger.record(alert, self.sink.name, outcome, attempts, error)

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
            self.delivering = False
            log.warning("alert not delivered, giving up: sink %s, event %s, incident %s, engine %s: %s "
                        "(%d attempt%s in %.1fs)", self.sink.name, alert.event, alert.incident_id, alert.engine,
                        describe_error(e), attempts, "" if attempts == 1 else "s", time.monotonic() - started)
            self.outcome(alert, "failed", attempts, describe_error(e))
        else:
            self.delivering = True
            self.outcome(alert, "delivered", attempts)
            log.debug("alert sink %s: delivered %s for incident %s (attempt %d)", self.sink.name, alert.event,
                      alert.incident_id, attempts)


class Dispatcher:
    """Sends each alert to every sink in the background; `submit` never blocks. With a ``ledger``, each outcome is
    written to it, and what it says was delivered or given up on (in a life before this one) is not sent again."""

    def __init__(self, sinks: Sequence[Sink], retry: RetryPolicy | None = None, *, queue_size: int = 256,
                 dedup_size: int = 4096, ledger: DeliveryLog | None = None) -> None:
        names = [s.name for s in sinks]
        if len(set(names)) != len(names):
            raise ValueError(f"alert sink names must be unique, got {names}")
        self._abort = threading.Event()
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict.fromkeys(
            sorted(ledger.settled())[-dedup_size:] if ledger else ())
        self._dedup_size = dedup_size
        self._closed = False
        self.ledger = ledger
        self._workers = [_Worker(s, retry or RetryPolicy(), queue_size, self._abort, ledger) for s in sinks]

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
                if not w.offer(alert):
                    log.warning("alert sink %s: queue full, dropped %s for incident %s", w.sink.name, alert.event,
                                alert.incident_id)
                    w.outcome(alert, "dropped", 0, "its queue was full")
                    continue
                self._seen[key] = None
                while len(self._seen) > self._dedup_size:
                    self._seen.popitem(last=False)

    def delivering(self) -> list[tuple[str, str, bool]]:
        """Each sink's (name, kind, whether its last alert was delivered): the exporter's
        ``watchdog_alert_sink_delivering``, which the shipped rules read to stand in for a failing Alertmanager sink."""
        return [(w.sink.name, str(getattr(w.sink, "kind", "")), w.delivering) for w in self._workers]

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
            w.stop()
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
        if self.ledger is not None:
            self.ledger.close()
        return drained and not any(w.thread.is_alive() for w in self._workers)



def build_dispatcher(cfg: Config, ledger: Path | None = None) -> Dispatcher | None:
    """The configured sinks, their URLs and secrets read now (a missing one is a ConfigError); None if none.
    ``ledger``: where the delivery log is kept (`watchdog.act.alert_log`), rolled over past
    ``state.events_max_bytes``."""
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
    return Dispatcher(sinks, RetryPolicy(attempts=cfg.alerts.attempts, total=cfg.alerts.retry_for),
                      ledger=DeliveryLog(ledger, cfg.state.events_max_bytes) if ledger else None)


def fault_alert(cfg: Config, stage: str, error: str, where: str, started: float) -> Alert:
    """The watchdog's own fault in one stage of its pass: one alert per stage and watchdog life (``started``, the
    life's start, makes the id the same all that life)."""
    fid = incident_id(started, cfg.engine.name, "-", f"fault-{stage}", "0")
    return Alert("watchdog_fault", fid, "-", cfg.engine.name, base_url(cfg.engine.url), "watchdog_fault",
                 f"the watchdog's {stage} stage failed: {error}", {"stage": stage, "error": error,
                                                                  "where": where[-2000:]})
