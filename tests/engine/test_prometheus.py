"""The shipped rules and dashboard against real parts: a real Prometheus scrapes the real `watchdog run` exporter
while a real vLLM (the shared one, CPU, TP=2) has a worker stopped under load; the frozen incident's alert goes through
a real Alertmanager (the shipped example: pages for critical, chat for warning) to a webhook receiver on loopback, and
every query of the dashboard answers with series.

The daemon's own Alertmanager sink is configured to an address where nothing listens: it gives up, says so
(watchdog_alert_sink_delivering 0), and the rules stand in for it with the very labels it would have sent (its
Alertmanager identity): one page, resolved when the engine works again. Both paths at once, and the escalation from a
warning: tests/unit/test_alertmanager_one_page.py.

The Prometheus and Alertmanager configurations are the shipped examples; the rules are the shipped file with only
the `for:` durations shortened (1/20) and RUNBOOK_BASE set as an operator would."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.prometheus import (
    DASHBOARD,
    RULES,
    Alertmanager,
    Prometheus,
    alertmanager_config,
    copy_rules,
    prometheus_config,
    wait_for,
)
from tests.harness.server import VllmServer, free_port
from tests.harness.watcher import WatchdogProcess, quick_config
from tests.receiver import Receiver
from watchdog.act.alerts import Alert, AlertmanagerSink
from watchdog.config.load import Config
from watchdog.core.runbooks import Runbook, runbook_link

pytestmark = pytest.mark.engine

BASE = "https://runbooks.test/engine-watchdog"
# what Grafana puts for its own variables in these queries (scrapes and evaluations every second here)
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$__range": "10m", "$__interval": "5s"}


def regex_value(value: str) -> str:
    """A label value as Grafana writes a single selected value into `=~"..."`: regex-escaped (in PromQL's string)."""
    return re.sub(r"([.\\+*?\[\]^$(){}|])", r"\\\\\1", value)


def resolve_variables(prom: Prometheus, dashboard: dict[str, Any]) -> dict[str, str]:
    """Each query variable's values as Prometheus answers its label_values(); the first one selected."""
    chosen: dict[str, str] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var
        selector = substitute(m[1], chosen)
        values = prom.label_values(m[2], selector)
        assert values, f"variable {var['name']}: label_values({selector}, {m[2]}) is empty"
        chosen[f"${var['name']}"] = regex_value(sorted(values)[0])
    return chosen


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name in sorted({**GRAFANA_VARIABLES, **variables}, key=len, reverse=True):
        expr = expr.replace(name, {**GRAFANA_VARIABLES, **variables}[name])
    return expr


def pages(sink: Receiver, status: str) -> list[dict[str, Any]]:
    """The alerts of each notification Alertmanager sent to the pager with this status."""
    return [a for p, _h, raw in sink.received if p == "/page" for a in [json.loads(raw)] if a["status"] == status]


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_frozen_engine_pages_once_through_alertmanager_and_every_dashboard_query_answers(
        shared_vllm: VllmServer, receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    server = shared_vllm
    fors = copy_rules(RULES, tmp_path / "rules.yml", for_scale=1 / 20, runbook_base=BASE)
    port = free_port()
    gone = closed_port_url()  # the daemon's own Alertmanager sink: nothing there, it gives up at once
    extra = (f'[capture]\ngap = 1.0\n[alerts]\nattempts = 1\n[[alerts.sinks]]\nkind = "alertmanager"\n'
             f'name = "am"\nurl = "{gone}"\n')
    w = WatchdogProcess(server.url, tmp_path / "watchdog", quick_config(3.0, 12.0, 5.0, extra), metrics_port=port)
    sink = receiver()
    am = Alertmanager(tmp_path / "alertmanager", alertmanager_config(f"{sink.url}/page", f"{sink.url}/chat"))
    prom = Prometheus(tmp_path / "prometheus",
                      prometheus_config(tmp_path / "rules.yml", f"127.0.0.1:{port}", am.address, interval="1s"))
    name = "EngineWatchdogEngineFrozen"
    try:
        w.start()
        am.start()
        prom.start()
        w.wait_for_state("idle", 60)
        wait_for("Prometheus scraping the watchdog", lambda: prom.query('watchdog_engine_state{state="idle"} == 1'),
                 30)
        time.sleep(5)  # a few evaluations of a healthy watchdog
        assert prom.firing() == [], "alerts on a healthy watchdog"
        with LoadGenerator(server.url, server.model_name, threads=4, duration=150, request_timeout=250):
            w.wait_for_state("working", 30)
            server.wait_running(1, 30)
            with frozen(server.process("VLLM::Worker_TP1")):
                stopped = time.time()
                w.wait_for_state("frozen", 60, after=stopped)
                opened = w.wait_event("incident_opened", 30)
                wait_for("the daemon's sink given up on", lambda: prom.query(
                    'watchdog_alert_sink_delivering{sink="am", kind="alertmanager"} == 0'), 60)
                wait_for(f"{name} firing in Prometheus", lambda: prom.firing(name), 30 + fors[name])
                got = wait_for(f"{name} paged", lambda: pages(sink, "firing"), 30)
                firing = sorted(a["labels"]["alertname"] for a in prom.firing())
                results = run_dashboard(prom)
                exported = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        # continued: the engine works again, the incident resolves, and so does the page
        w.wait_for_state("working", 60, after=stopped)
        wait_for(f"the resolved {name} paged", lambda: pages(sink, "resolved"), 60)
    except BaseException:
        print(f"--- prometheus ---\n{prom.log_tail()}\n--- alertmanager ---\n{am.log_tail()}\n"
              f"--- watchdog ---\n{w.log_tail()}")
        raise
    finally:
        prom.stop()
        am.stop()
        w.stop()

    [page] = got
    [alert] = page["alerts"]
    # the labels the daemon's own sink would have sent for this incident: Alertmanager's identity of the alert
    theirs = AlertmanagerSink("http://unused", host=socket.gethostname())
    [would] = json.loads(theirs.body(Alert("stall_detected", opened["incident"], "0", Config().engine.name,
                                           server.url, "frozen", "-", {"kind": "frozen"})))
    assert alert["labels"] == would["labels"], (alert["labels"], would["labels"])
    assert alert["labels"]["severity"] == "critical"  # nothing restarts it here: a human is needed
    assert alert["annotations"]["runbook_url"] == runbook_link(Runbook.FROZEN, BASE)
    assert opened["incident"] in alert["annotations"]["description"]
    assert page["version"] == "4" and page["receiver"] == "engine-pager"
    assert firing == [name], firing  # nothing else fired, on the way in or while frozen
    assert len(pages(sink, "firing")) == 1, pages(sink, "firing")
    assert not [p for p, _h, _b in sink.received if p == "/chat"]

    empty = sorted(q for q, series in results.items() if not series)
    gpu_only = [q for q in empty if "watchdog_gpu_" in q]
    assert not set(empty) - set(gpu_only), f"dashboard queries without series: {sorted(set(empty) - set(gpu_only))}"
    if gpu_only:  # no GPU (or no NVML) here: only while the exporter shows no GPU series may those queries be empty
        assert not re.search(r"^watchdog_gpu_\w+\{", exported, re.MULTILINE), f"GPU series not found by {gpu_only}"
    print(f"dashboard: {len(results) - len(empty)} of {len(results)} queries with series; empty (no GPU here): "
          f"{gpu_only}")


def run_dashboard(prom: Prometheus) -> dict[str, list[dict[str, Any]]]:
    """Every dashboard query (panels and annotations), variables substituted, as an instant query now."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = resolve_variables(prom, dashboard)
    exprs = [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    out: dict[str, list[dict[str, Any]]] = {}
    for expr in exprs:
        q = substitute(expr, variables)
        assert "$" not in q, f"a variable left unsubstituted: {q}"
        out[q] = prom.query(q)
    return out
