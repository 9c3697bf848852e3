"""``watchdog run``: the pipeline every interval until SIGTERM/SIGINT, with events, trace, metrics and systemd.

One pass: scrape and judge (`Watcher.tick`), report the transitions, hand them to the evidence coordinator and
feed finished stack checks back to the judge, then act on the verdicts (the incident machine: incidents, bundles,
alerts, restarts), write the status. Each stage of a pass runs inside an error boundary: a bug or a full disk in
one stage is logged, counted (``watchdog_pass_errors_total{stage}``) and alerted once, and the loop goes on.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.act.assemble import Act
from watchdog.act.incident_types import Incident
from watchdog.config.load import Config
from watchdog.core.types import (
    Observation,
    ProbeFinished,
    Scrape,
    State,
    Transition,
    Verdict,
    base_url,
    calm,
    iso,
)
from watchdog.evidence.bundle.coordinator import EvidenceCoordinator
from watchdog.evidence.bundle.investigate import EvidenceRunner, Investigator
from watchdog.evidence.collect.deadline_read import read_deadlines
from watchdog.evidence.gpu.nvml import GpuMonitor, NvmlSource
from watchdog.nodes.liveness import overlay
from watchdog.nodes.remote import RemoteEvidence
from watchdog.nodes.transport import close_links, open_links
from watchdog.nodes.watch import NodeWatch
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.service.events import EventLog, log_transition, transition_record
from watchdog.service.exporter import Exporter
from watchdog.service.probes import ProbeSettings, stale_after
from watchdog.service.sdnotify import Notifier
from watchdog.service.signals import StopSignals
from watchdog.service.state_check import StateDirCheck
from watchdog.service.status_file import StatusFile
from watchdog.service.trace import TraceWriter
from watchdog.service.watcher import ObservationSink, Watcher, build_watcher

log = logging.getLogger(__name__)

# The engine's timeouts are read at start and whenever an engine comes (back) into service (a restarted engine may
# have new ones), and at least this often. A read walks /proc for the engine's processes: 13-17 ms of CPU with vLLM
# TP=2 here, measured; every 5 minutes that was 7% of the service's CPU.
DEADLINES_EVERY = 3600.0
_UP = frozenset({State.IDLE, State.WORKING})
# While every engine is idle or working and nothing is open, running or reserved, the act stage (control file,
# heartbeat, status file, gauges) runs this often, not every pass: a calm pass decides nothing there (the service at
# 1 Hz: 0.0725% of a core against 0.0769% without, side by side, bench/profile_tick.py --cpu 150 --chunked --against;
# a noisier run: no difference). A pass that is not calm runs it at once.
RESPOND_CALM_EVERY = 5.0


def status_line(verdicts: list[Verdict]) -> str:
    if not verdicts:
        return "no verdict yet"
    return "; ".join(f"engine {v.engine}: {v.state.value}" for v in verdicts)


class Daemon:
    def __init__(self, cfg: Config, state_dir: Path, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.state_dir = state_dir
        self.url = base_url(cfg.engine.url)
        self.notifier = notifier or Notifier()
        self.exporter = Exporter(probes=ProbeSettings(cfg.exporter.live_after, stale_after(
            cfg.scrape.interval, cfg.scrape.deadline)), stack=cfg.engine.name)
        self.http = EngineHTTP(cfg.engine.url, cfg.scrape.limits(), cfg.api_key().reveal())
        self.events = EventLog(state_dir / "events.jsonl")
        self._trace: TraceWriter | None = None
        self._calm = False  # the last pass saw every engine idle or working, with no incident open
        self.signals = StopSignals()
        self.runner: EvidenceRunner | None = None
        self.gpu: GpuMonitor | None = None
        self._gpu_seen = 0.0  # wall time of the last GPU sample exported and traced
        self.evidence: EvidenceCoordinator | None = None
        self.act: Act | None = None
        self.nodes: NodeWatch | None = None  # [[nodes]]: every other node's ranks, for the verdicts
        self.remote: RemoteEvidence | None = None  # [[nodes]]: the other nodes' evidence (ssh masters, temp dirs)
        self.status_file = StatusFile(state_dir, {"stack": cfg.engine.name, "url": self.url,
                                                  "interval": cfg.scrape.interval},
                                      self.exporter.write_errors.labels("status.json").inc)
        self._faults_alerted: set[str] = set()
        self._started = time.time()
        self._deadlines: dict[str, object] | None = None
        self._deadlines_read = -DEADLINES_EVERY
        self._deadlines_due = False  # an engine came into service since the last read
        self._respond_next = float("-inf")  # a calm pass before this (monotonic) skips the act stage
        self._watcher: Watcher | None = None

    def run(self, once: bool = False) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        if self.cfg.state.trace_max_bytes:
            self._trace = TraceWriter(self.state_dir / "trace.jsonl", self.cfg.state.trace_max_bytes,
                                      {"url": self.url})
        if self.cfg.exporter.port and not once:
            self.exporter.state_problem = StateDirCheck(self.state_dir, lambda: self.events.failures)
            self.exporter.serve(self.cfg.exporter.listen, self.cfg.exporter.port)
        sinks: list[ObservationSink] = [self._count]
        if self._trace is not None:
            sinks.append(self._write_trace)
        watcher = build_watcher(self.cfg, self.http, sinks)
        self._watcher = watcher
        links = open_links(self.cfg.nodes)  # one connection per node, for liveness, capture and restart
        if not once:
            self.act = Act(self.cfg, self.state_dir, self._act_event, self.http, links, self._bundle)
            self.exporter.passes.sinks = self.act.delivering
        if self.cfg.gpu.enabled and not once:
            g = self.cfg.gpu
            self.gpu = GpuMonitor(NvmlSource(), g.interval, g.dense_interval, g.dense_for, g.keep_seconds)
            if self.gpu.start():
                self.gpu = None  # said once by the monitor: no GPU here, and nothing else happens
        if self.cfg.capture.enabled and not once:
            self.remote = RemoteEvidence(self.cfg, links) if self.cfg.nodes else None
            investigator = Investigator(self.cfg, self.http, gpu=self.gpu, others=self.remote,
                                        reading=lambda: watcher.page)  # the page the judge read last
            for problem in investigator.preflight():
                log.warning("evidence capture: %s", problem)
            self.runner = EvidenceRunner(investigator)
            self.evidence = EvidenceCoordinator(self.runner, self.cfg.judge.stall_window)
        if not once:
            self._read_deadlines()
        if self.cfg.nodes and not once:
            self.nodes = NodeWatch(self.cfg.nodes, links)
        self.signals.install()
        log.info("watching %s every %gs (suspect after %gs, frozen after %gs); state in %s", self.url,
                 self.cfg.scrape.interval, self.cfg.judge.suspect_after, self.cfg.judge.stall_window, self.state_dir)
        ready = False
        # Everything built so far (modules, config, sessions) lives as long as the process: out of the collector's
        # sight, a full collection walks only what the passes allocate.
        gc.freeze()
        try:
            while self.signals.received is None:
                started = time.monotonic()
                self.one_pass(watcher)
                line = status_line(watcher.judge.verdicts())
                if not ready:
                    self.notifier.ready(line)
                    ready = True
                else:
                    self.notifier.status(line)
                if once:
                    if watcher.prober is not None and watcher.prober.in_flight:
                        watcher.prober.wait(self.cfg.probe.timeout + 1)
                        self.one_pass(watcher)
                    break
                self.signals.sleep(started + self.cfg.scrape.interval - time.monotonic(), self.notifier)
        finally:
            self.notifier.stopping()
            if self.runner is not None:
                self.runner.stop()
            if self.gpu is not None:
                self.gpu.stop()
            if self.act is not None:
                self.act.close()
            if self.nodes is not None:
                self.nodes.close()
            close_links(links)
            self.signals.restore()
            self.events.close()
            if self._trace is not None:
                self._trace.close()
            self.http.close()
        if self.signals.received is not None:
            log.info("stopped by %s", signal.Signals(self.signals.received).name)
        return 0

    # -- one pass, each stage in its own error boundary ------------------------------------------------

    def one_pass(self, watcher: Watcher) -> None:
        transitions = self._guard("scrape", watcher.tick) or []
        self._calm = False  # until the report says so (a report stage that fails leaves it so: the act stage runs)
        self._guard("report", self._report, watcher, transitions)
        self._guard("evidence", self._evidence, watcher, transitions)
        self._guard("act", self._respond, watcher)
        self._guard("gpu", self._gpu_samples)

    def _guard(self, stage: str, fn: Callable[..., list[Transition] | None], *args: Any) -> list[Transition] | None:
        try:
            return fn(*args)
        except Exception as e:  # one stage's bug must not stop the watch
            self.exporter.pass_errors.labels(stage).inc()
            log.exception("the %s stage of this pass failed; the watch goes on", stage)
            self._fault(stage, f"{type(e).__name__}: {e}", traceback.format_exc(limit=4))
            return None

    def _fault(self, stage: str, error: str, where: str = "") -> None:
        """Tell people once per stage and watchdog life; an event when the disk lets us."""
        self.events.write({"time": iso(time.time()), "event": "watchdog_fault", "stack": self.cfg.engine.name,
                           "stage": stage, "error": error})
        if stage not in self._faults_alerted and self.act is not None:
            self._faults_alerted.add(stage)
            self.act.fault(stage, error, where, self._started)

    # -- reporting -------------------------------------------------------------------------------------

    def _count(self, obs: Observation, _wall: float) -> None:
        if isinstance(obs, Scrape):
            self.exporter.observe_scrape(obs)
        elif isinstance(obs, ProbeFinished):
            self.exporter.observe_probe(obs)

    def _write_trace(self, obs: Observation, wall: float) -> None:
        assert self._trace is not None
        try:
            # a calm scrape waits a few seconds for company; anything else, or trouble, goes out at once
            self._trace.write(obs, wall, hold=self._calm and isinstance(obs, Scrape))
        except OSError as e:
            self.exporter.write_errors.labels("trace.jsonl").inc()
            self._fault("trace", f"cannot write trace.jsonl: {e.strerror or e}")

    def _report(self, watcher: Watcher, transitions: list[Transition]) -> None:
        verdicts = watcher.judge.verdicts()
        self.exporter.observe_transitions(transitions)
        self.exporter.set_verdicts(verdicts, watcher.clock())
        quiet = not transitions and calm(verdicts) and (self.act is None or not self.act.incident_open)
        if not quiet and self._trace is not None:
            try:
                self._trace.flush()  # what led here is on disk before anything is done about it
            except OSError as e:
                self.exporter.write_errors.labels("trace.jsonl").inc()
                self._fault("trace", f"cannot write trace.jsonl: {e.strerror or e}")
        self._calm = quiet
        for tr in transitions:
            if tr.to_state in _UP and tr.from_state not in _UP:
                self._deadlines_due = True  # (back) in service: its processes, and their timeouts, may be new
            log_transition(self.cfg.engine.name, tr)
            self._event(transition_record(self.cfg.engine.name, self.url, tr, watcher.wall_of(tr.t)))
            if self.gpu is not None and tr.to_state in (State.SUSPECT, State.FROZEN):
                self.gpu.dense()  # the timeline around a freeze, sampled densely from the suspicion on

    def _gpu_samples(self) -> None:
        """New GPU samples to the metrics and the trace (power beside the page, for replay and for people)."""
        if self.gpu is None:
            return
        fresh = [s for s in self.gpu.window(self._gpu_seen) if s.t > self._gpu_seen]
        for s in fresh:
            self.exporter.observe_gpu(s)
            if self._trace is not None:
                try:
                    self._trace.write_record({"kind": "gpu", **s.to_json()})
                except OSError as e:
                    self.exporter.write_errors.labels("trace.jsonl").inc()
                    self._fault("trace", f"cannot write trace.jsonl: {e.strerror or e}")
        if fresh:
            self._gpu_seen = max(s.t for s in fresh)

    def _event(self, record: dict[str, object]) -> None:
        self.exporter.observe_record(record)
        if (err := self.events.write(record)) is not None:
            self.exporter.write_errors.labels("events.jsonl").inc()
            if self.events.failures == 1 and "events" not in self._faults_alerted and self.act is not None:
                self._faults_alerted.add("events")
                self.act.fault("events", f"cannot write events.jsonl: {err.strerror or err}", "", self._started)

    # -- evidence: the coordinator asks for stacks; checks go back to the judge, bundles to the incident --

    def _evidence(self, watcher: Watcher, transitions: list[Transition]) -> None:
        if self.evidence is None:
            return
        now = watcher.clock()
        for tr in transitions:
            self.evidence.on_transition(tr, now)
        for engine in watcher.judge.wants_stacks(now):
            self.evidence.check(engine, "looking at the stacks again", now)
        for out in self.evidence.collect(now):
            self._event({"time": iso(time.time()), "stack": self.cfg.engine.name, **out.event})
            if out.observation is not None:
                fed = watcher.feed(out.observation)
                self._report(watcher, fed)
                for tr in fed:
                    self.evidence.on_transition(tr, watcher.clock())
            if self.act is not None and out.incident is not None:
                i = out.incident
                self.act.stacks(i.engine, i.decision, i.bundle, i.details, i.final, i.incident)

    def _bundle(self, incident: Incident) -> None:
        """An incident opened: its bundle, asked of the evidence stage (none when capture is off)."""
        if self.evidence is not None and self._watcher is not None:
            w = self._watcher
            self.evidence.bundle(incident.engine, State(incident.kind.value), incident.id, incident.reason,
                                 w.clock(), self._stalled_since(w, incident.engine))

    @staticmethod
    def _stalled_since(watcher: Watcher, engine: str) -> float | None:
        """Wall time the judge's stall of ``engine`` began (its last progress, or work pending since), None when
        it sees no stall: a freeze's GPU states are read from there to the capture."""
        tr = watcher.judge.tracks.get(engine)
        start = tr.stall_start if tr is not None else None
        return watcher.wall_of(start) if start is not None else None

    # -- act: incidents, alerts, restarts --------------------------------------------------------------------

    def _act_event(self, record: dict[str, object]) -> None:
        self.exporter.observe_event(str(record["event"]))
        self._event({"time": iso(time.time()), "stack": self.cfg.engine.name, **record})

    def _respond(self, watcher: Watcher) -> None:
        if self.act is None:
            return
        now = time.monotonic()
        verdicts = watcher.judge.verdicts()
        local, views, nodes_well = verdicts, [], True  # this node's own verdicts, the other nodes' views
        if self.nodes is not None:  # a rank lost on another node is down; a node not seen makes it blind
            views = self.nodes.views()
            for v in self.nodes.changes(views):
                log.warning("node %s: %s: %s", v.node, v.status, v.reason)
                self._event({"time": iso(time.time()), "stack": self.cfg.engine.name, "event": "node_state",
                             "node": v.node, "state": v.status, "reason": v.reason})
            local, verdicts = verdicts, overlay(verdicts, views)
            nodes_well = all(v.status == "ok" for v in views)
            self.exporter.set_overlaid(verdicts, local, watcher.clock())  # /readyz and /livez see the other nodes
        calm_here = self._calm and nodes_well and self.act.settled
        if calm_here and now < self._respond_next and not self._deadlines_due:
            return  # calm, and nothing open, running or reserved: the act stage has nothing to do on this pass
        status = self.act.step(verdicts, watcher.clock(), watcher.judge.last_scrape_ok, local, views)
        self.exporter.set_response(status)
        self._respond_next = now + RESPOND_CALM_EVERY if calm_here else now
        if self._deadlines_due or now - self._deadlines_read >= DEADLINES_EVERY:
            self._read_deadlines()
        self.status_file.update(verdicts, status, self._deadlines, now, watcher.clock(), time.time())

    def _read_deadlines(self) -> None:
        """The engine's own timeouts against our confirmation time: warned at start and when the warning changes."""
        before = self._deadlines and self._deadlines.get("warning")
        self._deadlines_read, self._deadlines_due = time.monotonic(), False
        try:
            self._deadlines = read_deadlines(self.cfg, self.url).as_dict()
        except Exception as e:  # reading /proc must not stop the watch
            log.warning("cannot read the engine's timeouts: %s: %s", type(e).__name__, e)
            return
        if self._deadlines["warning"] and self._deadlines["warning"] != before:
            log.warning("deadline: %s", self._deadlines["warning"])
