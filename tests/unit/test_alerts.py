"""Alert sinks against real local HTTP receivers, and the dispatcher's retry, dedup and non-blocking promises."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from watchdog.act.alert_log import DeliveryLog
from watchdog.act.alerts import (
    EVENTS,
    Alert,
    AlertmanagerSink,
    Dispatcher,
    RetryPolicy,
    SlackSink,
    WebhookSink,
    build_dispatcher,
    verify_signature,
)
from watchdog.act.heartbeat import Heartbeat
from watchdog.config.load import ConfigError, Secret, load
from watchdog.core.types import iso

SECRET = "hmac-s3cret-value-42"
TOKEN = "T0KEN-in-the-path-99"
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")

@pytest.fixture
def dispatcher() -> Iterator[Callable[..., Dispatcher]]:
    made: list[Dispatcher] = []

    def make(*args: Any, **kwargs: Any) -> Dispatcher:
        d = Dispatcher(*args, **kwargs)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close(timeout=0.5)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def alert(event: str = "stall_detected", incident: str = "inc-1", **kw: object) -> Alert:
    args: dict[str, Any] = {"engine": "0", "stack": "qwen", "url": "http://127.0.0.1:8000", "state": "frozen",
                               "summary": f"{event} happened", "details": {}, "time": 1_700_000_000.5}
    args.update(kw)
    return Alert(event, incident, **args)


class Counting:
    """Wraps a sink to count attempts. With `gated`, every attempt first waits until the test opens the gate, so
    what a test does meanwhile provably happened while the sink had not answered (no clock involved)."""

    def __init__(self, sink: WebhookSink, gated: bool = False) -> None:
        self.sink, self.name, self.calls = sink, sink.name, 0
        self.gate = threading.Event()
        if not gated:
            self.gate.set()

    def send(self, a: Alert) -> None:
        self.calls += 1
        if not self.gate.wait(30):
            raise AssertionError("the test never opened the gate")
        self.sink.send(a)


class Held:
    """A sink whose every send waits until the test releases it (``entered`` says one is waiting); what it then
    sends is recorded in ``sent``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entered, self.release = threading.Event(), threading.Event()
        self.sent: list[str] = []

    def send(self, a: Alert) -> None:
        self.entered.set()
        if not self.release.wait(30):
            raise AssertionError("never released")
        self.sent.append(a.incident_id)


def gave_up(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "giving up" in r.getMessage()]


DETAILS = {"stall_detected": {"verdict": "frozen: no tokens for 40s", "kind": "frozen"},
           "evidence_captured": {"verdict": "stuck", "bundle": "/var/lib/engine-watchdog/incidents/x.tar.gz"},
           "recovered": {"downtime": 812.5}}


def test_events_arrive_in_order_with_documented_payloads(receiver, dispatcher) -> None:
    hook, slack, am = receiver(), receiver(), receiver()
    d = dispatcher([WebhookSink(hook.url + "/hook?x=1", Secret(SECRET)), SlackSink(slack.url + "/services/T/B/C"),
                    AlertmanagerSink(am.url + "/", host="gpu-1")], RetryPolicy.instant())
    alerts = [alert(e, details=DETAILS.get(e, {}), time=1_700_000_000.0 + i, resolved=e == "resolved")
              for i, e in enumerate(EVENTS)]
    for a in alerts:
        d.submit(a)
    assert d.wait_idle(10)

    bodies = hook.bodies()
    assert [b["event"] for b in bodies] == list(EVENTS)
    for b, a in zip(bodies, alerts, strict=True):
        assert b == {"version": 1, "event": a.event, "incident_id": "inc-1", "engine": "0", "stack": "qwen",
                     "url": "http://127.0.0.1:8000", "state": "frozen", "summary": a.summary,
                     "details": DETAILS.get(a.event, {}), "time": b["time"], "resolved": a.event == "resolved",
                     "runbook": "", "severity": "critical"}
        assert ISO.match(b["time"])
    assert bodies[0]["time"] == "2023-11-14T22:13:20.000Z"
    for path, headers, raw in hook.received:
        assert path == "/hook?x=1"
        assert headers["Content-Type"] == "application/json"
        assert verify_signature(Secret(SECRET), raw, headers["X-Watchdog-Signature"])
        assert not verify_signature(Secret("wrong"), raw, headers["X-Watchdog-Signature"])
        assert not verify_signature(Secret(SECRET), raw + b" ", headers["X-Watchdog-Signature"])
        assert abs(int(headers["X-Watchdog-Timestamp"]) - time.time()) < 60

    texts = slack.bodies()
    assert len(texts) == len(EVENTS)
    for t, a in zip(texts, alerts, strict=True):
        assert a.event in t["text"] or a.resolved
        assert "qwen" in t["text"] and "inc-1" in t["text"]
        assert t["blocks"][0]["type"] == "section"
    assert "RESOLVED" in texts[-1]["text"]
    assert all(p == "/services/T/B/C" for p, _h, _b in slack.received)

    posts = am.bodies()
    assert all(p == "/api/v2/alerts" for p, _h, _b in am.received)
    assert len(posts) == len(EVENTS)
    for post, a in zip(posts, alerts, strict=True):
        assert isinstance(post, list) and len(post) == 1
        one = post[0]
        assert one["labels"] == {"alertname": "EngineWatchdogEngineFrozen", "engine": "0", "stack": "qwen",
                                 "host": "gpu-1", "incident_id": "inc-1", "severity": "critical"}
        assert {"summary", "description"} <= set(one["annotations"])
        assert ISO.match(one["startsAt"])
        assert one["generatorURL"] == "http://127.0.0.1:8000"
        assert ("endsAt" in one) == a.resolved
    assert posts[1][0]["annotations"]["bundle"] == DETAILS["evidence_captured"]["bundle"]
    assert posts[-1][0]["endsAt"] == iso(1_700_000_000.0 + len(EVENTS) - 1)  # resolved, the last of EVENTS


def test_webhook_without_secret_is_unsigned(receiver, dispatcher) -> None:
    hook = receiver()
    d = dispatcher([WebhookSink(hook.url)], RetryPolicy.instant())
    d.submit(alert())
    assert d.wait_idle(10)
    [(_p, headers, _b)] = hook.received
    assert "X-Watchdog-Signature" not in headers and "X-Watchdog-Timestamp" not in headers


def test_an_idle_sink_thread_sleeps_until_an_alert_comes(receiver, dispatcher) -> None:
    """No polling: with a webhook configured, the sink's thread is not run at all while nothing is sent (the kernel's
    count of the times it ran, /proc/self/task/TID/schedstat), wakes for an alert, and ends on close."""
    hook = receiver()
    d = dispatcher([WebhookSink(hook.url, name="hook")], RetryPolicy.instant())
    [worker] = [t for t in threading.enumerate() if t.name == "alerts-hook"]
    stat = Path(f"/proc/self/task/{worker.native_id}/schedstat")

    def runs() -> int:
        return int(stat.read_text().split()[2])

    time.sleep(0.3)  # into its wait
    before = runs()
    time.sleep(1.5)  # the old worker polled its queue every 0.2 s: 7 runs here
    assert runs() == before
    d.submit(alert())
    assert d.wait_idle(10) and len(hook.received) == 1
    assert d.close(timeout=2) is True and not worker.is_alive()


def test_close_with_a_full_queue_behind_a_slow_send_still_ends_the_thread(caplog) -> None:
    """The sink is in a send that has not answered and its queue is full when the service closes: the rest is
    dropped under abort, and the thread ends once the send returns (the stop always fits in the queue)."""
    slow = Held("slow")
    d = Dispatcher([slow], RetryPolicy.instant(), queue_size=2)
    d.submit(alert(incident="inc-0"))
    assert slow.entered.wait(10)
    d.submit(alert(incident="inc-1"))
    d.submit(alert(incident="inc-2"))  # the queue is full now
    [worker] = [t for t in threading.enumerate() if t.name == "alerts-slow"]
    assert d.close(timeout=0.2) is False  # not drained: the send has not returned
    slow.release.set()
    worker.join(10)
    assert not worker.is_alive(), "the sink's thread outlived close()"
    dropped = [r.getMessage() for r in caplog.records if "closing, dropped" in r.getMessage()]
    assert len(dropped) == 2 and "inc-1" in dropped[0] and "inc-2" in dropped[1], dropped


def test_alertmanager_alertname_follows_the_incident_kind() -> None:
    am = AlertmanagerSink("http://am:9093", firing_ttl=3600)
    # one incident keeps one alertname (labels are Alertmanager's identity), so `resolved` ends the right alert
    assert am.alertname(alert("engine_down", "a", state="down")) == "EngineWatchdogEngineDown"
    assert am.alertname(alert("restart_started", "a", state="starting")) == "EngineWatchdogEngineDown"
    assert am.alertname(alert("resolved", "a", state="healthy", resolved=True)) == "EngineWatchdogEngineDown"
    assert am.alertname(alert("stall_detected", "b")) == "EngineWatchdogEngineFrozen"
    assert am.alertname(alert("engine_down", "b", state="down")) == "EngineWatchdogEngineFrozen"
    boot = alert("gave_up", "c", state="starting", details={"kind": "boot_timeout"})
    assert am.alertname(boot) == "EngineWatchdogEngineStartingTooLong"
    fresh = AlertmanagerSink("http://am:9093")  # e.g. after a watchdog restart: details["kind"] says it
    resolved = alert("resolved", "a", state="healthy", details={"kind": "down"})
    assert fresh.alertname(resolved) == "EngineWatchdogEngineDown"
    [firing] = json.loads(am.body(alert(time=0.0)))
    assert firing["endsAt"] == "1970-01-01T01:00:00.000Z"  # held open, not ended by resolve_timeout


def test_a_blind_incident_is_one_blind_alert_from_blind_to_resolved() -> None:
    am = AlertmanagerSink("http://am:9093")
    assert am.alertname(alert("blind", "d", state="blind", details={"kind": "blind"})) == "EngineWatchdogEngineBlind"
    assert am.alertname(alert("blind_frozen", "d", state="blind")) == "EngineWatchdogEngineBlind"
    assert am.alertname(alert("resolved", "d", state="idle", resolved=True)) == "EngineWatchdogEngineBlind"
    fresh = AlertmanagerSink("http://am:9093")  # no kind in the details, none remembered: the event says it
    assert fresh.alertname(alert("blind", "e", state="blind")) == "EngineWatchdogEngineBlind"
    [ended] = json.loads(fresh.body(alert("resolved", "e", state="idle", resolved=True, time=5.0)))
    assert ended["labels"]["alertname"] == "EngineWatchdogEngineBlind" and ended["endsAt"] == iso(5.0)


def test_down_receiver_is_retried_then_given_up_without_blocking(dispatcher, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="watchdog.act.alerts")
    sink = Counting(WebhookSink(closed_port_url(), Secret(SECRET), name="ops-hook", connect_timeout=1), gated=True)
    d = dispatcher([sink], RetryPolicy.instant(attempts=4))
    d.submit(alert("engine_down", incident="inc-down"))  # returns with the first attempt not even made
    assert sink.calls <= 1 and not d.wait_idle(0)
    sink.gate.set()
    assert d.wait_idle(20)
    assert sink.calls == 4
    [line] = gave_up(caplog)
    for part in ("ops-hook", "engine_down", "inc-down", "connection failed", "4 attempts"):
        assert part in line


def test_slow_receiver_never_delays_submit_and_is_given_up(receiver, dispatcher, caplog) -> None:
    slow = receiver(lambda _n: (200, 2.0))
    sink = Counting(WebhookSink(slow.url, read_timeout=0.5), gated=True)
    d = dispatcher([sink], RetryPolicy.instant(attempts=2))
    d.submit(alert())
    d.submit(alert("evidence_captured"))  # both return while no attempt can have been answered
    assert slow.hits == 0 and not d.wait_idle(0)
    sink.gate.set()
    assert d.wait_idle(20)
    assert sink.calls == 4
    lines = gave_up(caplog)
    assert len(lines) == 2 and all("read timeout" in x and "2 attempts" in x for x in lines)


def test_slow_first_answer_is_retried_and_delivered(receiver, dispatcher, caplog) -> None:
    slow_once = receiver(lambda n: (200, 2.0 if n == 1 else 0.0))
    d = dispatcher([WebhookSink(slow_once.url, read_timeout=0.5)], RetryPolicy.instant(attempts=3))
    d.submit(alert())
    assert d.wait_idle(20)
    assert slow_once.hits == 2
    # the second attempt's copy is here; the first (slow) one may land too, later: receivers deduplicate
    assert [b["event"] for b in slow_once.bodies()][:1] == ["stall_detected"]
    assert gave_up(caplog) == []


def test_500_then_200_is_delivered_on_retry(receiver, dispatcher, caplog) -> None:
    flaky = receiver(lambda n: (500 if n == 1 else 200, 0.0))
    d = dispatcher([SlackSink(flaky.url)], RetryPolicy.instant(attempts=3))
    d.submit(alert())
    assert d.wait_idle(10)
    assert flaky.hits == 2 and len(flaky.bodies()) == 1
    assert gave_up(caplog) == []


def test_client_error_is_not_retried(receiver, dispatcher, caplog) -> None:
    bad = receiver(lambda _n: (400, 0.0))
    d = dispatcher([AlertmanagerSink(bad.url)], RetryPolicy.instant(attempts=5))
    d.submit(alert())
    assert d.wait_idle(10)
    assert bad.hits == 1
    [line] = gave_up(caplog)
    assert "HTTP 400" in line and "1 attempt " in line


def test_same_alert_is_delivered_once_per_sink(receiver, dispatcher) -> None:
    hook = receiver()
    d = dispatcher([WebhookSink(hook.url)], RetryPolicy.instant())
    d.submit(alert())
    d.submit(alert())  # equal, another object
    d.submit(alert(summary="reworded"))  # same incident and event: still a duplicate
    d.submit(alert("evidence_captured"))
    d.submit(alert(incident="inc-2"))
    assert d.wait_idle(10)
    got = [(b["incident_id"], b["event"]) for b in hook.bodies()]
    assert got == [("inc-1", "stall_detected"), ("inc-1", "evidence_captured"), ("inc-2", "stall_detected")]


def test_secrets_never_logged_even_on_failure(receiver, dispatcher, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="watchdog")
    failing = receiver(lambda _n: (500, 0.0))
    sinks = [WebhookSink(f"{closed_port_url()}/hook/{TOKEN}?token={TOKEN}", Secret(SECRET), name="down-hook"),
             WebhookSink(f"{failing.url}/hook/{TOKEN}", Secret(SECRET), name="failing-hook"),
             SlackSink(f"{failing.url}/services/{TOKEN}"), AlertmanagerSink(f"{failing.url}/{TOKEN}")]
    d = dispatcher(sinks, RetryPolicy.instant(attempts=2))
    d.submit(alert())
    assert d.wait_idle(20)
    assert len(gave_up(caplog)) == 4
    text = caplog.text + "".join(str(r.args) for r in caplog.records) + repr(sinks)
    assert SECRET not in text and TOKEN not in text
    assert "down-hook" in text and "failing-hook" in text


def test_submit_never_blocks_on_a_full_queue(dispatcher, caplog) -> None:
    stuck = Held("stuck")
    d = dispatcher([stuck], RetryPolicy.instant(), queue_size=1)
    d.submit(alert(incident="inc-0"))
    assert stuck.entered.wait(10)  # the worker holds inc-0 and cannot finish it: the queue (one place) is empty
    submitter = threading.Thread(target=lambda: [d.submit(alert(incident=f"inc-{i}")) for i in range(1, 20)])
    submitter.start()
    submitter.join(10)  # a deadline only: a blocking submit would wait for `release`, set below, forever
    assert not submitter.is_alive(), "submit blocked on the stuck sink"
    stuck.release.set()
    assert d.wait_idle(10)
    assert stuck.sent == ["inc-0", "inc-1"]  # the one held, the one queued; the other 18 dropped, each said so
    full = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
    assert len(full) == 18 and "inc-19" in full[-1], full


def test_close_cuts_a_long_backoff_short(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="watchdog.act.alerts")
    backing_off = threading.Event()

    class Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying in" in record.getMessage():
                backing_off.set()

    signal = Signal()
    logging.getLogger("watchdog.act.alerts").addHandler(signal)
    try:
        sink = Counting(WebhookSink(closed_port_url(), name="down"))
        # an hour's backoff: any deadline below is nothing next to it, on however loaded a machine
        d = Dispatcher([sink], RetryPolicy(attempts=5, wait_initial=3600, wait_max=3600, total=7200, jitter=0))
        d.submit(alert())
        assert backing_off.wait(10)  # the first attempt failed; the worker is about to wait an hour
        [worker] = [t for t in threading.enumerate() if t.name == "alerts-down"]
        assert d.close(timeout=0.2) is False  # not drained in time
        worker.join(30)
        assert not worker.is_alive(), "close() left the worker in its backoff"
        assert sink.calls < 5  # given up before the policy's attempts ran out: the backoff was cut, not served
        [line] = gave_up(caplog)
        assert "inc-1" in line
        d.submit(alert("resolved"))  # after close: dropped, not raised
    finally:
        logging.getLogger("watchdog.act.alerts").removeHandler(signal)


def test_validation() -> None:
    with pytest.raises(ValueError, match="unknown alert event"):
        alert("exploded")
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="unique"):
        Dispatcher([SlackSink("http://a"), SlackSink("http://b")])


# -- configured sinks and the dead-man heartbeat -------------------------------------------------------------


def test_sinks_from_config_read_urls_and_secrets_from_env_and_files(tmp_path, receiver, monkeypatch) -> None:
    hook, slack = receiver(), receiver()
    (tmp_path / "slack-url").write_text(slack.url + f"/services/{TOKEN}\n")
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    cfg_file = tmp_path / "w.toml"
    cfg_file.write_text(f"""
[alerts]
attempts = 1
[[alerts.sinks]]
kind = "webhook"
url = "{hook.url}/h"
secret_env = "HOOK_SECRET"
[[alerts.sinks]]
kind = "slack"
url_file = "{tmp_path / 'slack-url'}"
""")
    d = build_dispatcher(load(cfg_file))
    assert d is not None
    d.submit(alert())
    assert d.wait_idle(10)
    d.close()
    [(_p, headers, raw)] = hook.received
    assert verify_signature(Secret(SECRET), raw, headers["X-Watchdog-Signature"])
    assert [p for p, _h, _b in slack.received] == [f"/services/{TOKEN}"]
    monkeypatch.delenv("HOOK_SECRET")
    with pytest.raises(ConfigError, match=r"alerts.sinks\[0\].secret_env: the environment variable HOOK_SECRET"):
        build_dispatcher(load(cfg_file))
    assert build_dispatcher(load(None)) is None


def test_heartbeat_pings_only_after_an_observing_pass_and_at_most_once_an_interval() -> None:
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        hb = Heartbeat(Secret(f"http://127.0.0.1:{srv.server_address[1]}/ping/{TOKEN}"), interval=60)
        assert hb.beat(0.0, observed=False) is False  # blind: never
        assert hb.beat(1.0, observed=True) is True
        hb.wait(5)
        assert hb.beat(30.0, observed=True) is False  # within the interval
        assert hb.beat(61.5, observed=True) is True
        hb.wait(5)
        assert hits == [f"/ping/{TOKEN}"] * 2 and hb.sent == 2
        down = Heartbeat(Secret(closed_port_url() + "/ping"), interval=1)
        assert down.beat(0.0, observed=True)
        down.wait(10)
        assert down.failed == 1
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_heartbeat_pings_over_one_connection_for_its_life_closed_with_it() -> None:
    peers: list[tuple[str, int]] = []
    gone = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the connection stays open between pings

        def do_GET(self) -> None:
            peers.append(self.client_address)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def finish(self) -> None:
            super().finish()
            gone.set()

        def log_message(self, format: str, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        hb = Heartbeat(Secret(f"http://127.0.0.1:{srv.server_address[1]}/ping"), interval=1)
        for now in (0.0, 1.0, 2.0):
            assert hb.beat(now, observed=True)
            hb.wait(5)
        assert hb.sent == 3 and len(peers) == 3 and len(set(peers)) == 1
        assert not gone.is_set()
        hb.close()
        assert gone.wait(5), "closing the heartbeat left its connection open"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_an_incident_in_hand_is_a_warning_until_it_pages_then_the_page_is_resolved(receiver, dispatcher) -> None:
    """Labels are an alert's identity in Alertmanager: the escalation ends the warning and fires the page in one post,
    and the resolve ends the page (the alert that was sent), whatever severity the resolving event carries."""
    am = receiver()
    d = dispatcher([AlertmanagerSink(am.url, host="gpu-1")], RetryPolicy.instant())
    for i, (event, severity) in enumerate([("stall_detected", "warning"), ("restart_started", "warning"),
                                           ("restart_failed", "critical"), ("gave_up", "critical"),
                                           ("resolved", "warning")]):
        d.submit(alert(event, "inc-9", time=100.0 + i, resolved=event == "resolved", severity=severity))
        assert d.wait_idle(10)
    posts = am.bodies()
    sent = [[(a["labels"]["severity"], "endsAt" in a) for a in post] for post in posts]
    assert sent == [[("warning", False)], [("warning", False)], [("warning", True), ("critical", False)],
                    [("critical", False)], [("critical", True)]], sent
    ended_warning = posts[2][0]
    assert ended_warning["endsAt"] == iso(102.0)
    assert ended_warning["labels"]["alertname"] == "EngineWatchdogEngineFrozen"
    assert {a["labels"]["incident_id"] for post in posts for a in post} == {"inc-9"}


def test_an_unknown_severity_is_refused() -> None:
    with pytest.raises(ValueError, match="severity"):
        alert(severity="page")


def test_each_sink_says_whether_its_last_alert_was_delivered(receiver, dispatcher) -> None:
    """The exporter's watchdog_alert_sink_delivering: the shipped rules stand in while the Alertmanager sink fails."""
    up = receiver()
    d = dispatcher([AlertmanagerSink(up.url, name="am"), AlertmanagerSink(closed_port_url(), name="am-gone",
                                                                          connect_timeout=1)],
                   RetryPolicy.instant(attempts=2))
    assert d.delivering() == [("am", "alertmanager", True), ("am-gone", "alertmanager", True)]  # nothing sent yet
    d.submit(alert())
    assert d.wait_idle(20)
    assert d.delivering() == [("am", "alertmanager", True), ("am-gone", "alertmanager", False)]


def test_every_outcome_is_logged_and_a_new_life_sends_nothing_delivered_or_given_up_before(
        tmp_path, receiver, dispatcher) -> None:
    ledger = tmp_path / "alerts.jsonl"
    hook = receiver()
    sinks = [WebhookSink(hook.url, name="up"), WebhookSink(closed_port_url(), name="gone", connect_timeout=1)]
    first = dispatcher(sinks, RetryPolicy.instant(attempts=2), ledger=DeliveryLog(ledger))
    first.submit(alert("stall_detected", "inc-7"))
    assert first.wait_idle(20)
    first.close(timeout=1)  # a watchdog SIGKILLed here would leave the same file: a line per outcome, as it came
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    by_sink = {x["sink"]: x for x in lines}
    assert by_sink["up"]["outcome"] == "delivered" and by_sink["up"]["attempts"] == 1
    assert by_sink["gone"]["outcome"] == "failed" and by_sink["gone"]["attempts"] == 2
    assert "connection failed" in by_sink["gone"]["error"] and "127.0.0.1" not in by_sink["gone"]["error"]
    assert {x["incident"] for x in lines} == {"inc-7"} and all(ISO.match(x["time"]) for x in lines)
    with ledger.open("a") as f:
        f.write('{"incident": "inc-7", "event": "evidence_cap')  # torn by a kill
    again = receiver()
    second = dispatcher([WebhookSink(again.url, name="up")], RetryPolicy.instant(), ledger=DeliveryLog(ledger))
    second.submit(alert("stall_detected", "inc-7"))  # the next life says it again: delivered before, not resent
    second.submit(alert("evidence_captured", "inc-7"))  # the torn line settled nothing: this one goes
    assert second.wait_idle(10)
    assert [(b["incident_id"], b["event"]) for b in again.bodies()] == [("inc-7", "evidence_captured")]


def test_an_alert_given_up_on_one_sink_is_not_settled_for_another(tmp_path, receiver, dispatcher) -> None:
    ledger = tmp_path / "alerts.jsonl"
    DeliveryLog(ledger).record(alert(), "old-sink", "failed", 3, "HTTP 503")
    DeliveryLog(ledger).record(alert(incident="inc-9"), "ops", "dropped", 0, "its queue was full")
    hook = receiver()
    d = dispatcher([WebhookSink(hook.url, name="ops")], RetryPolicy.instant(), ledger=DeliveryLog(ledger))
    d.submit(alert())
    d.submit(alert(incident="inc-9"))  # dropped is not settled: a new life sends it
    assert d.wait_idle(10)
    assert sorted(b["incident_id"] for b in hook.bodies()) == ["inc-1", "inc-9"]
