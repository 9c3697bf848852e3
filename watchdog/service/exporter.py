"""The watchdog's own metrics, exported with prometheus-client."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from watchdog import __version__
from watchdog.core.types import ProbeFinished, Scrape, State, Transition, Verdict
from watchdog.evidence.gpu.readings import GpuSample
from watchdog.service.probes import (
    Answer,
    OpenIncident,
    ProbeSettings,
    carry_trouble,
    liveness,
    probe_problems,
    readiness,
)

log = logging.getLogger(__name__)


class Exporter:
    def __init__(self, registry: CollectorRegistry | None = None, probes: ProbeSettings | None = None,
                 stack: str = "", host: str | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # /readyz and /livez (watchdog.service.probes decides): the last pass as one tuple (verdicts, their clock, the
        # monotonic time it was handed over), so a probe never reads half of one pass and half of the next
        self.probe_settings = probes or ProbeSettings()
        self._last: tuple[list[Verdict], float, float] | None = None
        self._trouble: dict[str, float] = {}  # engine -> since when frozen or down without a break
        self._incident: OpenIncident | None = None
        self._born = time.monotonic()
        self.state_problem: Callable[[], str] = lambda: ""  # the state directory's health (service.state_check)
        self.passes = _PassValues()  # set by every pass as plain values; turned into metrics when exported
        # [[nodes]]: the verdicts with the other nodes' view laid over them (the daemon's respond step hands them
        # over) and since when each of those has been frozen or down: what the probes answer from, when set
        self._overlaid: tuple[list[Verdict], dict[str, float]] | None = None
        self._overlay_since: dict[str, tuple[State, float]] = {}  # engine -> a state the overlay gave it, since
        if registry is None:
            ProcessCollector(registry=self.registry)
        r = self.registry
        self._state_shown: dict[str, State] = {}
        self._response_shown: tuple[object, ...] = ()
        self.state = Gauge("watchdog_engine_state", "1 for the engine's current state, 0 for the others",
                           ["engine", "state"], registry=r)
        r.register(self.passes)
        self.scrape_errors = Counter("watchdog_scrape_errors", "Failed scrapes by kind", ["kind"], registry=r)
        self.probes = Counter("watchdog_probes", "Probe generations by result", ["result"], registry=r)
        self.transitions = Counter("watchdog_transitions", "State transitions",
                                   ["engine", "from_state", "to_state"], registry=r)
        self.paused = Gauge("watchdog_paused", "1 while paused for maintenance (no action, no alert)", registry=r)
        self.budget_left = Gauge("watchdog_restart_budget_remaining", "Restarts left in the budget window",
                                 registry=r)
        self.gave_up = Gauge("watchdog_gave_up", "1 after the budget was spent: observe only until reset", registry=r)
        self.recovering = Gauge("watchdog_recovery_seconds",
                                "Seconds into the recovery in progress, by phase (restarting, proving); 0 when none",
                                ["phase"], registry=r)
        self.incident_open = Gauge("watchdog_incident_open", "1 while an incident is open", registry=r)
        # who this is, as the daemon's own Alertmanager alerts say it (the rules join it in: one page per incident)
        Info("watchdog", "The watched stack ([engine] name), this host and the version", registry=r).info(
            {"stack": stack, "host": socket.gethostname() if host is None else host, "version": __version__})
        self.incident_info = Gauge("watchdog_incident_info", "1 for the open incident: its engine, id, kind and "
                                   "alert severity (warning while restarted within the budget)",
                                   ["engine", "incident_id", "kind", "severity"], registry=r)
        self.pause_end = Gauge("watchdog_pause_end_timestamp_seconds", "When the pause ends (wall time); 0 when "
                               "not paused or paused until `watchdog resume`", registry=r)
        self.blind = Gauge("watchdog_blind_seconds", "Seconds the watchdog has not seen it (what: page, or node:NAME); "
                           "0 once seen again (a blind incident opens at alerts.blind_after)", ["what"], registry=r)
        self._blind_shown: set[str] = set()
        self.actions = Counter("watchdog_incident_events", "Incident events (restart_started, recovered, ...)",
                               ["event"], registry=r)
        self.pass_errors = Counter("watchdog_pass_errors", "Stages of a pass that failed (the watch went on)",
                                   ["stage"], registry=r)
        self.write_errors = Counter("watchdog_write_errors", "Writes to the state directory that failed (disk full?)",
                                    ["file"], registry=r)
        # durations, from the events that carry them: a stacks capture (a check or a freeze's bundle) and a recovery
        self.capture_seconds = Histogram("watchdog_capture_seconds", "Seconds the stacks capture behind a check or "
                                         "a bundle took", ["event"], buckets=_CAPTURE_BUCKETS, registry=r)
        self.downtime = Histogram("watchdog_recovery_downtime_seconds", "Seconds from the incident to serving again, "
                                  "per recovery", buckets=_DOWNTIME_BUCKETS, registry=r)
        # shown at 0 from the start, so the first of each counts in increase() and rate() (a series born at 1 does not)
        for name in _EVENTS_SHOWN:
            self.actions.labels(name)
        for name in ("evidence_checked", "evidence_captured"):
            self.capture_seconds.labels(name)
        self.gpu_util = Gauge("watchdog_gpu_utilization_percent", "NVML utilisation of each GPU", ["gpu"], registry=r)
        self.gpu_power = Gauge("watchdog_gpu_power_watts", "NVML power draw of each GPU", ["gpu"], registry=r)
        self.gpu_clock = Gauge("watchdog_gpu_sm_clock_mhz", "NVML SM clock of each GPU", ["gpu"], registry=r)
        self._metrics_app = make_wsgi_app(self.registry)
        self.port = 0

    def serve(self, listen: str, port: int) -> int:
        """prometheus_client's server in a thread, as `start_http_server` makes it, except that its loop sleeps until
        a request comes: `start_http_server`'s wakes twice a second to look for a shutdown nobody asks for (measured:
        0.03% of a core, a third of the whole service's). Started once; it lives as long as the process."""
        info = socket.getaddrinfo(listen, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("ExporterServer", (ThreadingWSGIServer,), {"address_family": info[0]})  # v4 or v6
        server: ThreadingWSGIServer = make_server(str(info[4][0]), port, self.app, server_class,
                                                  handler_class=QuietHandler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": None}, name="exporter",
                         daemon=True).start()
        self.port = int(server.server_address[1])
        log.info("exporting watchdog metrics on http://%s:%d/metrics", listen, self.port)
        return self.port

    def observe_scrape(self, s: Scrape) -> None:
        p = self.passes
        p.scrapes += 1
        p.last_scrape = s.wall
        if s.error_kind:
            self.scrape_errors.labels(s.error_kind).inc()

    def observe_probe(self, p: ProbeFinished) -> None:
        self.probes.labels("ok" if p.ok else ("failed" if p.answered else "no_answer")).inc()

    def observe_transitions(self, transitions: Iterable[Transition]) -> None:
        for tr in transitions:
            self.transitions.labels(tr.engine, tr.from_state.value if tr.from_state else "none",
                                    tr.to_state.value).inc()

    def set_verdicts(self, verdicts: list[Verdict], now: float) -> None:
        changed = False
        for v in verdicts:
            if self._state_shown.get(v.engine) != v.state:  # the one-hot gauges change with the state only
                for state in State:
                    self.state.labels(v.engine, state.value).set(1.0 if v.state == state else 0.0)
                self._state_shown[v.engine] = v.state
                changed = True
        if changed:  # frozen or down since when: only a change of state can change it
            self._trouble = carry_trouble(self._trouble, verdicts)
        self.passes.verdicts, self.passes.now = verdicts, now
        self._last = (verdicts, now, time.monotonic())

    def set_overlaid(self, verdicts: list[Verdict], local: list[Verdict], now: float) -> None:
        """[[nodes]]: the pass's verdicts with the other nodes' view laid over them (``local``: the same without),
        for /readyz and /livez, states and trouble clock alike. A state the overlay gave an engine counts from when it
        was first seen so (``now``, the verdicts' clock), not from the local state's ``since``."""
        states = {v.engine: v.state for v in local}
        seen: list[Verdict] = []
        for v in verdicts:
            if v.state != states.get(v.engine):
                before = self._overlay_since.get(v.engine)
                since = before[1] if before is not None and before[0] == v.state else now
                self._overlay_since[v.engine] = (v.state, since)
                seen.append(replace(v, since=since))
            else:
                self._overlay_since.pop(v.engine, None)
                seen.append(v)
        self._overlaid = (seen, carry_trouble(self._overlaid[1] if self._overlaid else {}, seen))

    def set_response(self, status: dict[str, Any]) -> None:
        unseen = {str(b["what"]): float(b["seconds"]) for b in status.get("blind") or ()}
        if unseen or self._blind_shown:  # what the watchdog cannot see, and for how long; 0 once seen again
            for what in self._blind_shown | unseen.keys():
                self.blind.labels(what).set(unseen.get(what, 0.0))
            self._blind_shown = set(unseen)
        inc = status.get("incident")
        self._incident = (OpenIncident(str(inc.get("engine")), str(inc.get("id")), str(inc.get("phase", "open")))
                          if isinstance(inc, dict) else None)
        rec = status.get("recovery") or {}
        shown = (status.get("paused"), status.get("paused_until"), status.get("budget_left"), status.get("gave_up"),
                 json.dumps([inc, [b.get("incident") for b in status.get("blind") or ()]], sort_keys=True, default=str),
                 rec.get("phase"), rec.get("seconds"))
        if shown == self._response_shown:  # the same as last pass: nothing to set
            return
        self._response_shown = shown
        self.paused.set(1.0 if status.get("paused") else 0.0)
        self.budget_left.set(float(status.get("budget_left", 0)))
        self.gave_up.set(1.0 if status.get("gave_up") else 0.0)
        self.incident_open.set(1.0 if status.get("incident") else 0.0)
        until = status.get("paused_until")
        self.pause_end.set(float(until) if status.get("paused") and isinstance(until, (int, float)) else 0.0)
        self.incident_info.clear()
        if isinstance(inc, dict):
            self.incident_info.labels(str(inc.get("engine")), str(inc.get("id")), str(inc.get("kind")),
                                      "warning" if inc.get("in_hand") else "critical").set(1.0)
        for b in status.get("blind") or ():  # a blind incident is never acted on: a human is needed
            if b.get("incident"):
                self.incident_info.labels(str(b.get("engine")), str(b["incident"]), "blind", "critical").set(1.0)
        for phase in ("restarting", "proving"):
            self.recovering.labels(phase).set(float(rec.get("seconds", 0.0)) if rec.get("phase") == phase else 0.0)

    def observe_gpu(self, s: GpuSample) -> None:
        for gauge, value in ((self.gpu_util, s.util), (self.gpu_power, s.power_w), (self.gpu_clock, s.sm_clock_mhz)):
            if value is not None:
                gauge.labels(str(s.index)).set(float(value))

    def observe_event(self, name: str) -> None:
        self.actions.labels(name).inc()

    def observe_record(self, record: dict[str, object]) -> None:
        """The durations an event carries (an evidence event's ``capture_seconds``, a recovery's ``downtime``)."""
        event = record.get("event")
        value = record.get("capture_seconds") if event in ("evidence_checked", "evidence_captured") else (
            record.get("downtime") if event == "recovered" else None)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            return
        if event == "recovered":
            self.downtime.observe(float(value))
        else:
            self.capture_seconds.labels(str(event)).observe(float(value))


    # -- HTTP: /metrics, /readyz, /livez; anything else 404, any method but GET or HEAD 405 ----------------------

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO") or "/", environ.get("REQUEST_METHOD", "")
        if path not in _PATHS:
            return _reply(start_response, 404, {"error": f"no such path: {path[:100]}", "paths": _PATHS}, method)
        if method not in ("GET", "HEAD"):
            return _reply(start_response, 405, {"error": f"{method[:20]} not allowed"}, method,
                          [("Allow", "GET, HEAD")])
        if path in ("/readyz", "/livez"):
            try:
                answer = self.probe(path[1:], environ.get("QUERY_STRING", ""))
            except Exception as e:  # a bug here must answer, never end the thread or the process
                log.exception("the %s probe failed", path)
                answer = Answer(500, {"error": f"{type(e).__name__}: {e}"[:300]})
            return _reply(start_response, answer.code, answer.body, method)
        body: Iterable[bytes] = self._metrics_app(environ, start_response)
        return [] if method == "HEAD" else body

    def probe(self, kind: str, query: str = "") -> Answer:
        """The answer of ``/readyz`` (kind "readyz") or ``/livez`` now; ``query`` may name one engine (engine=ID)."""
        try:
            args = parse_qs(query, keep_blank_values=True, strict_parsing=False, max_num_fields=10)
        except ValueError as e:
            return Answer(400, {"error": f"bad query: {e}"[:200]})
        engine = args.get("engine", [None])[-1]
        if engine is not None and not engine.strip():
            return Answer(400, {"error": "engine= needs an engine id (vLLM's engine label: 0, 1, ...)"})
        last, mono = self._last, time.monotonic()
        verdicts, now, age = ([], 0.0, None) if last is None else (last[0], last[1] + mono - last[2], mono - last[2])
        trouble, overlaid = self._trouble, self._overlaid
        if verdicts and overlaid is not None:  # [[nodes]]: states and trouble from the same overlaid verdicts
            verdicts, trouble = overlaid
        if verdicts and age is not None:  # a pass whose scrape stage keeps failing hands over old verdicts: the
            age = max(age, now - min(v.t for v in verdicts))  # oldest one counts, so none hides behind another
        ready_problem, live_problem = probe_problems(age, mono - self._born, self.probe_settings,
                                                     self.state_problem() if kind == "readyz" else "")
        if kind == "readyz":
            return readiness(verdicts, now, self._incident, ready_problem, engine)
        return liveness(verdicts, now, trouble, self._incident, live_problem, self.probe_settings.live_after,
                        engine)


_PATHS = ("/", "/metrics", "/metrics/", "/readyz", "/livez")
_EVENTS_SHOWN = ("incident_opened", "restart_started", "recovered", "restart_failed", "gave_up", "resolved")
_CAPTURE_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
_DOWNTIME_BUCKETS = (15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)


def _reply(start_response: Callable[..., Any], code: int, body: dict[str, object], method: str,
           headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    data = json.dumps(body).encode() + b"\n"
    start_response(f"{code} {_REASONS.get(code, 'Error')}",
                   [("Content-Type", "application/json"), ("Cache-Control", "no-store"),
                    ("Content-Length", str(len(data))), *(headers or [])])
    return [] if method == "HEAD" else [data]


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


class QuietHandler(WSGIRequestHandler):
    """No access log; a connection that sends nothing for ``timeout`` seconds is dropped (an idle client must not
    hold a thread and a socket for ever)."""

    timeout = 10.0

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:  # idle past the timeout: the server closes the connection, quietly
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


class _PassValues(Collector):
    """What changes on every pass, kept as plain values and made into metrics only when someone reads them: a pass
    stores two numbers and a list instead of taking a metric's lock four times (measured: the exporter's share of a
    cold pass 40 -> 5 us)."""

    def __init__(self) -> None:
        self.scrapes = 0
        self.last_scrape = 0.0
        self.verdicts: list[Verdict] = []
        self.now = 0.0
        self.sinks: Callable[[], list[tuple[str, str, bool]]] = list  # the alert sinks' delivery (act.alerts)

    def collect(self) -> Iterable[Metric]:
        verdicts, now = self.verdicts, self.now  # one pass's list and clock, read once
        scrapes = CounterMetricFamily("watchdog_scrapes", "Scrapes of the engine's /metrics")
        scrapes.add_metric([], self.scrapes)
        last = GaugeMetricFamily("watchdog_last_scrape_timestamp_seconds", "Wall time of the last scrape")
        last.add_metric([], self.last_scrape)
        since = GaugeMetricFamily("watchdog_engine_seconds_since_progress",
                                  "Seconds since the engine last showed progress (NaN before any)", labels=["engine"])
        stalled = GaugeMetricFamily("watchdog_engine_stalled_seconds",
                                    "Seconds of pending work without progress (0 when not stalled)", labels=["engine"])
        for v in verdicts:
            since.add_metric([v.engine], float("nan") if v.last_progress is None else max(0.0, now - v.last_progress))
            stalled.add_metric([v.engine], v.stalled_for)
        sinks = GaugeMetricFamily("watchdog_alert_sink_delivering", "1 while the sink's last alert was delivered (or "
                                  "none was sent yet), 0 after one was given up on", labels=["sink", "kind"])
        for name, kind, ok in self.sinks():
            sinks.add_metric([name, kind], 1.0 if ok else 0.0)
        return [scrapes, last, since, stalled, sinks]
