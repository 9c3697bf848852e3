"""The watchdog's own metrics as prometheus_client's parser reads them back: per-pass values kept as plain numbers
must come out as the same series a Gauge or Counter would give."""

from __future__ import annotations

import math
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import watchdog.service.exporter as exporter_module
from watchdog import __version__
from watchdog.core.types import PageReading, Scrape, State, Verdict
from watchdog.nodes.liveness import NodeView, overlay
from watchdog.service.exporter import Exporter
from watchdog.service.probes import ProbeSettings


def samples(e: Exporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(e.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_per_pass_values_read_back_as_metrics() -> None:
    e = Exporter()
    for i in range(3):
        e.observe_scrape(Scrape(float(i), 1e9 + i, PageReading({}, 0)))
    e.observe_scrape(Scrape(3.0, 1e9 + 3, None, "refused", "nothing listening"))
    e.set_verdicts([Verdict("0", State.WORKING, "moved", 0.0, 10.0, 0.0, last_progress=7.5),
                    Verdict("1", State.SUSPECT, "no progress", 2.0, 10.0, 6.0, last_progress=None)], 10.0)
    got = samples(e)
    assert got[("watchdog_scrapes_total", ())] == 4
    assert got[("watchdog_last_scrape_timestamp_seconds", ())] == 1e9 + 3
    assert got[("watchdog_scrape_errors_total", (("kind", "refused"),))] == 1
    assert got[("watchdog_engine_seconds_since_progress", (("engine", "0"),))] == 2.5
    assert math.isnan(got[("watchdog_engine_seconds_since_progress", (("engine", "1"),))])
    assert got[("watchdog_engine_stalled_seconds", (("engine", "1"),))] == 6.0
    assert got[("watchdog_engine_state", (("engine", "1"), ("state", "suspect")))] == 1.0
    assert got[("watchdog_engine_state", (("engine", "1"), ("state", "working")))] == 0.0


def test_an_engine_gone_from_the_verdicts_is_gone_from_the_per_pass_series() -> None:
    e = Exporter()
    e.set_verdicts([Verdict("0", State.IDLE, "", 0.0, 1.0), Verdict("1", State.IDLE, "", 0.0, 1.0)], 1.0)
    e.set_verdicts([Verdict("0", State.IDLE, "", 0.0, 2.0)], 2.0)
    engines = {dict(k[1]).get("engine") for k in samples(e) if k[0] == "watchdog_engine_stalled_seconds"}
    assert engines == {"0"}


def test_response_gauges_follow_a_changed_status_only() -> None:
    e = Exporter()
    status = {"paused": False, "budget_left": 3, "gave_up": None, "incident": None,
              "recovery": {"phase": "restarting", "seconds": 4.0}}
    e.set_response(status)
    assert samples(e)[("watchdog_recovery_seconds", (("phase", "restarting"),))] == 4.0
    e.set_response({**status, "recovery": None, "budget_left": 2})
    got = samples(e)
    assert got[("watchdog_recovery_seconds", (("phase", "restarting"),))] == 0.0
    assert got[("watchdog_restart_budget_remaining", ())] == 2


def _runs(native_id: int) -> int:
    """How many times the kernel has run this thread (schedstat's third field)."""
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[2])


def test_the_exporter_answers_and_sleeps_between_requests() -> None:
    e = Exporter()
    others = {t.ident for t in threading.enumerate()}
    port = e.serve("127.0.0.1", 0)
    [thread] = [t for t in threading.enumerate() if t.name == "exporter" and t.ident not in others]  # this one
    assert thread.native_id is not None
    time.sleep(0.3)  # into its wait (on a loaded box a fresh thread may not be there yet: seen in a full unit run)
    before = _runs(thread.native_id)
    time.sleep(1.5)  # prometheus_client's own loop would have woken three times by now
    assert _runs(thread.native_id) == before
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "watchdog_scrapes_total 0.0" in text


def test_the_exporter_listens_on_ipv6_when_asked() -> None:
    if not socket.has_ipv6:
        return
    try:
        socket.getaddrinfo("::1", 0, type=socket.SOCK_STREAM)
    except OSError:
        return
    port = Exporter().serve("::1", 0)
    assert requests.get(f"http://[::1]:{port}/metrics", timeout=10).status_code == 200


def _frozen_clock(monkeypatch: pytest.MonkeyPatch, start: float) -> list[float]:
    """The exporter's monotonic clock, moved by the test (the verdicts' clock is the same here)."""
    clock = [start]
    monkeypatch.setattr(exporter_module, "time", SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    return clock


def test_one_engine_with_old_verdicts_cannot_hide_behind_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staleness counts from the oldest verdict: an engine whose judging fails every pass keeps its old verdict, and a
    fresh verdict of another engine must not make the pair look current."""
    clock = _frozen_clock(monkeypatch, 1000.0)
    e = Exporter(probes=ProbeSettings(live_after=300.0, stale_after=30.0))
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 0.0, 1000.0), Verdict("1", State.IDLE, "idle", 0.0, 900.0)],
                   1000.0)
    for kind in ("readyz", "livez"):
        a = e.probe(kind)
        assert a.code == 503 and "no pass for 100s" in str(a.body["watchdog"]), kind
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 0.0, 1000.0), Verdict("1", State.IDLE, "idle", 0.0, 999.0)],
                   1000.0)
    clock[0] = 1001.0
    assert e.probe("readyz").code == 200


def test_livez_counts_trouble_from_the_same_overlaid_verdicts_it_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    """[[nodes]]: the daemon hands over the verdicts with the other nodes' view laid over them once, and /livez's
    trouble clock follows them: a rank lost on another node (shown down) fails /livez after live_after, counted from
    when it was seen; a local freeze that the overlay shows as blind does not."""
    clock = _frozen_clock(monkeypatch, 1000.0)
    e = Exporter(probes=ProbeSettings(live_after=60.0, stale_after=1e9))
    lost = [NodeView("w1", "rank_lost", "rank 1 on w1 is gone")]

    def one_pass(local: list[Verdict], views: list[NodeView]) -> None:
        e.set_verdicts(local, clock[0])
        e.set_overlaid(overlay(local, views), local, clock[0])

    working = [Verdict("0", State.WORKING, "moved", 0.0, 1000.0)]  # working since long ago
    one_pass(working, lost)
    a = e.probe("livez")
    assert a.code == 200 and a.body["state"] == "down"  # down since now: live_after has not passed
    assert e.probe("readyz").code == 503
    clock[0] = 1030.0
    one_pass([Verdict("0", State.WORKING, "moved", 0.0, 1030.0)], lost)
    assert e.probe("livez").code == 200
    clock[0] = 1061.0
    one_pass([Verdict("0", State.WORKING, "moved", 0.0, 1061.0)], lost)
    a = e.probe("livez")
    assert a.code == 503 and a.body["state"] == "down" and a.body["for_seconds"] == 61.0

    e = Exporter(probes=ProbeSettings(live_after=60.0, stale_after=1e9))
    blind = [NodeView("w1", "blind", "node w1 not seen for 30s")]
    frozen = [Verdict("0", State.FROZEN, "nothing moves", 500.0, 1061.0)]  # frozen locally for 561 s
    e.set_verdicts(frozen, clock[0])
    assert e.probe("livez").code == 503  # without nodes: the local freeze counts
    e.set_overlaid(overlay(frozen, blind), frozen, clock[0])
    a = e.probe("livez")
    assert a.code == 200 and a.body["state"] == "blind"


def test_the_open_incident_is_one_series_with_the_alert_labels_and_gone_once_resolved() -> None:
    """What the rules turn into the same alert as the daemon's own (deploy/prometheus/watchdog-rules.yml)."""
    e = Exporter(stack="llama", host="gpu-1")
    assert samples(e)[("watchdog_info", (("host", "gpu-1"), ("stack", "llama"), ("version", __version__)))] == 1.0
    e.set_response({"incident": {"id": "i1", "engine": "0", "kind": "frozen", "in_hand": True}, "budget_left": 2})
    assert incidents(e) == {(("engine", "0"), ("incident_id", "i1"), ("kind", "frozen"), ("severity", "warning"))}
    e.set_response({"incident": {"id": "i1", "engine": "0", "kind": "frozen", "in_hand": False}, "budget_left": 1})
    assert incidents(e) == {(("engine", "0"), ("incident_id", "i1"), ("kind", "frozen"), ("severity", "critical"))}
    e.set_response({"incident": None, "blind": [{"what": "page", "seconds": 90.0, "incident": "b1", "engine": "0"}]})
    assert incidents(e) == {(("engine", "0"), ("incident_id", "b1"), ("kind", "blind"), ("severity", "critical"))}
    e.set_response({"incident": None, "blind": []})
    assert incidents(e) == set()


def test_a_pause_without_an_end_shows_zero_and_one_with_an_end_its_time() -> None:
    e = Exporter()
    e.set_response({"incident": None, "paused": True, "paused_until": None})
    assert samples(e)[("watchdog_paused", ())] == 1.0
    assert samples(e)[("watchdog_pause_end_timestamp_seconds", ())] == 0.0
    e.set_response({"incident": None, "paused": True, "paused_until": 1_900_000_000.0})
    assert samples(e)[("watchdog_pause_end_timestamp_seconds", ())] == 1_900_000_000.0


def incidents(e: Exporter) -> set[tuple[tuple[str, str], ...]]:
    return {labels for (name, labels), value in samples(e).items() if name == "watchdog_incident_info" and value == 1}
