"""One incident, one page, through a real Alertmanager (Debian's prometheus-alertmanager) running the shipped example
configuration: the daemon's own sink (the real `AlertmanagerSink` behind the real `Dispatcher`) and the alerts the
shipped rules make for the same incident (posted here with the labels the promtool tests check them to have) are one
alert; a freeze the watchdog restarts within its budget goes to chat; the failed restart pages once; the give-up that
follows is inhibited by that page; the resolve ends it.

The rules themselves, evaluated by a real Prometheus over a real `watchdog run`: tests/engine/test_prometheus.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.harness.prometheus import ALERTMANAGER_BIN, Alertmanager, alertmanager_config, wait_for
from tests.receiver import Receiver
from watchdog.act.alerts import Alert, AlertmanagerSink, Dispatcher, RetryPolicy
from watchdog.core.types import iso

SETTLE = 4.0  # seconds: several of the test config's 1 s group_interval, for a notification that must not come
INCIDENT = "20261204T031500Z-llama-0-frozen-a1b2"


@pytest.fixture
def stack(tmp_path: Path, receiver: Callable[..., Receiver]) -> Iterator[tuple[Alertmanager, Receiver, Dispatcher]]:
    assert ALERTMANAGER_BIN.exists(), "scripts/setup installs Debian's prometheus-alertmanager"
    sink = receiver()
    am = Alertmanager(tmp_path / "am", alertmanager_config(f"{sink.url}/page", f"{sink.url}/chat", group_wait="1s"))
    am.start()
    d = Dispatcher([AlertmanagerSink(am.url, host="gpu-1")], RetryPolicy.instant())
    try:
        yield am, sink, d
    except BaseException:
        print(f"--- alertmanager ---\n{am.log_tail()}")
        raise
    finally:
        d.close()
        am.stop()


def daemon(d: Dispatcher, event: str, severity: str, at: float, resolved: bool = False) -> None:
    d.submit(Alert(event, INCIDENT, "0", "llama", "http://127.0.0.1:8000", "frozen", f"{event} said",
                   {"kind": "frozen"}, at, resolved, severity=severity))
    assert d.wait_idle(10)


def as_the_rules_send(am: Alertmanager, alertname: str, severity: str, resolved: bool = False, **labels: str) -> None:
    """What Prometheus posts for a rule: its labels, its annotations, an endsAt a few minutes ahead while it holds,
    now once it stopped holding."""
    now = time.time()
    body = [{"labels": {"alertname": alertname, "severity": severity, **labels},
             "annotations": {"summary": f"{alertname} from the rules"}, "startsAt": iso(now - 60),
             "endsAt": iso(now if resolved else now + 240), "generatorURL": "http://prometheus:9090/graph"}]
    requests.post(f"{am.url}/api/v2/alerts", json=body, timeout=10).raise_for_status()


def notifications(sink: Receiver, path: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each notification to ``path``: its status and its alerts (name, severity, status)."""
    return [(b["status"], [(a["labels"]["alertname"], a["labels"]["severity"], a["status"]) for a in b["alerts"]])
            for p, _h, b in ((p, h, _json(raw)) for p, h, raw in sink.received) if p == path]


def _json(raw: bytes) -> Any:
    return json.loads(raw)


def held(am: Alertmanager) -> list[dict[str, Any]]:
    return list(requests.get(f"{am.url}/api/v2/alerts", params={"active": "true", "inhibited": "true"},
                             timeout=10).json())


def test_a_restarted_freeze_chats_its_failed_restart_pages_once_and_the_give_up_adds_no_page(stack) -> None:
    am, sink, d = stack
    incident = {"engine": "0", "stack": "llama", "host": "gpu-1", "incident_id": INCIDENT}
    t0 = time.time()
    daemon(d, "stall_detected", "warning", t0)
    as_the_rules_send(am, "EngineWatchdogEngineFrozen", "warning", **incident)  # the same alert, by the rules
    wait_for("the warning in chat", lambda: notifications(sink, "/chat"), 30)
    time.sleep(SETTLE)
    assert notifications(sink, "/page") == []
    assert notifications(sink, "/chat") == [("firing", [("EngineWatchdogEngineFrozen", "warning", "firing")])]
    assert [a["labels"] for a in held(am)] == [{"alertname": "EngineWatchdogEngineFrozen", "severity": "warning",
                                               **incident}]  # one alert, however many paths

    daemon(d, "restart_failed", "critical", t0 + 1)  # the escalation: the warning ends, the page fires
    as_the_rules_send(am, "EngineWatchdogEngineFrozen", "warning", resolved=True, **incident)  # its series changed
    as_the_rules_send(am, "EngineWatchdogEngineFrozen", "critical", **incident)
    wait_for("the page", lambda: notifications(sink, "/page"), 30)
    daemon(d, "gave_up", "critical", t0 + 2)
    as_the_rules_send(am, "EngineWatchdogGaveUp", "critical", job="engine-watchdog", instance="gpu-1:9830",
                      stack="llama", host="gpu-1")
    time.sleep(SETTLE)
    assert notifications(sink, "/page") == [("firing", [("EngineWatchdogEngineFrozen", "critical", "firing")])]
    gave_up = [a for a in held(am) if a["labels"]["alertname"] == "EngineWatchdogGaveUp"]
    assert [a["status"]["state"] for a in gave_up] == ["suppressed"] and gave_up[0]["status"]["inhibitedBy"]
    assert not [a for a in held(am) if a["labels"]["severity"] == "warning"]  # the warning ended with the page

    # a human fixes the engine and runs `watchdog reset` (the give-up ends); the engine serves: the incident resolves
    as_the_rules_send(am, "EngineWatchdogGaveUp", "critical", resolved=True, job="engine-watchdog",
                      instance="gpu-1:9830", stack="llama", host="gpu-1")
    as_the_rules_send(am, "EngineWatchdogEngineFrozen", "critical", resolved=True, **incident)
    daemon(d, "resolved", "critical", time.time(), resolved=True)
    wait_for("the page resolved", lambda: [n for n in notifications(sink, "/page") if n[0] == "resolved"], 30)
    time.sleep(SETTLE)
    assert notifications(sink, "/page") == [("firing", [("EngineWatchdogEngineFrozen", "critical", "firing")]),
                                            ("resolved", [("EngineWatchdogEngineFrozen", "critical", "resolved")])]
