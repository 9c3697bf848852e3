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
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.act.alerts import fault_alert
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
from watchdog.evidence.collect.deadline_read import read_deadlines
from watchdog.nodes.liveness import overlay
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.service.compose import Clock, Hooks, Parts, compose
from watchdog.service.events import EventLog, log_transition, transition_record
from watchdog.service.exporter import Exporter
from watchdog.service.probes import ProbeSettings, stale_after
from watchdog.service.sdnotify import Notifier
from watchdog.service.signals import StopSignals
from watchdog.service.state_check import StateDirCheck
from watchdog.service.status_file import StatusFile
from watchdog.service.watcher import Watcher

log = logging.getLogger(__name__)

# The engine's timeouts are read at start and whenever an engine comes (back) into service (a restarted engine may
# have new ones), and at least this often. A read walks /proc for the engine's processes (13-17 ms of CPU with vLLM
# TP=2 here): hourly, a negligible share of the service's CPU.
DEADLINES_EVERY = 3600.0
_UP = frozenset({State.IDLE, State.WORKING})


def status_line(verdicts: list[Verdict]) -> str:
    if not verdicts:
        return "no verdict yet"
    return "; ".join(f"engine {v.engine}: {v.state.value}" for v in verdicts)


class Daemon:
    """The loop over one pass. Its parts come from the composition root (`watchdog.service.compose`); the pass
    (`one_pass`) is every stage in order, each in its own error boundary."""

    def __init__(self, cfg: Config, state_dir: Path, notifier: Notifier | None = None,
                 clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.state_dir = state_dir
        self.clock = clock or Clock()
        self.url = base_url(cfg.engine.url)
        self.notifier = notifier or Notifier()
        self.exporter = Exporter(probes=ProbeSettings(cfg.exporter.live_after, stale_after(
            cfg.scrape.interval, cfg.scrape.deadline)), stack=cfg.engine.name)
        self.http = EngineHTTP(cfg.engine.url, cfg.scrape.limits(), cfg.api_key().reveal())  # the engine's one
        self.events = EventLog(state_dir / "events.jsonl", cfg.state.events_max_bytes)
        self.parts = Parts()  # built by run(); a test may set its own
        self._calm = False  # the last pass saw every engine idle or working, with no incident open
        self.signals = StopSignals()
        self._gpu_seen = 0.0  # wall time of the last GPU sample exported and traced
        self.status_file = StatusFile(state_dir, {"stack": cfg.engine.name, "url": self.url,
                                                  "interval": cfg.scrape.interval},
                                      self.exporter.write_errors.labels("status.json").inc)
        self._faults_alerted: set[str] = set()
        self._started = self.clock.wall()
        self._deadlines: dict[str, object] | None = None
        self._deadlines_read = -DEADLINES_EVERY
        self._deadlines_due = False  # an engine came into service since the last read

    def run(self, once: bool = False) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        if self.cfg.exporter.port and not once:
            self.exporter.state_problem = StateDirCheck(self.state_dir, lambda: self.events.failures)
            self.exporter.serve(self.cfg.exporter.listen, self.cfg.exporter.port)
        hooks = Hooks(self._count, self._write_trace, self._act_event, self._bundle)
        try:
            self.parts = parts = compose(self.cfg, self.state_dir, self.http, hooks, self.clock, once)
            assert parts.watcher is not None
            watcher = parts.watcher
            self.exporter.passes.sinks = parts.delivering
            if not once:
                self._read_deadlines()
            self.signals.install()
            log.info("watching %s every %gs (suspect after %gs, frozen after %gs); state in %s", self.url,
                     self.cfg.scrape.interval, self.cfg.judge.suspect_after, self.cfg.judge.stall_window,
                     self.state_dir)
            # Everything built so far (modules, config, sessions) lives as long as the process: out of the
            # collector's sight, a full collection walks only what the passes allocate.
            gc.freeze()
            self._loop(watcher, once)
        finally:
            self.notifier.stopping()
            self.parts.close()
            self.signals.restore()
            self.events.close()
            self.http.close()
        if self.signals.received is not None:
            log.info("stopped by %s", signal.Signals(self.signals.received).name)
        return 0

    def _loop(self, watcher: Watcher, once: bool) -> None:
        ready = False
        while self.signals.received is None:
            started = self.clock.mono()
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
            self.signals.sleep(started + self.cfg.scrape.interval - self.clock.mono(), self.notifier)

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
        self.events.write({"time": iso(self.clock.wall()), "event": "watchdog_fault", "stack": self.cfg.engine.name,
                           "stage": stage, "error": error})
        if stage not in self._faults_alerted:
            self._faults_alerted.add(stage)
            self.parts.submit(fault_alert(self.cfg, stage, error, where, self._started))

    # -- reporting -------------------------------------------------------------------------------------

    def _count(self, obs: Observation, _wall: float) -> None:
        if isinstance(obs, Scrape):
            self.exporter.observe_scrape(obs)
        elif isinstance(obs, ProbeFinished):
            self.exporter.observe_probe(obs)

    def _write_trace(self, obs: Observation, wall: float) -> None:
        if (trace := self.parts.trace) is None:
            return
        try:
            # a calm scrape waits a few seconds for company; anything else, or trouble, goes out at once
            trace.write(obs, wall, hold=self._calm and isinstance(obs, Scrape))
        except OSError as e:
            self.exporter.write_errors.labels("trace.jsonl").inc()
            self._fault("trace", f"cannot write trace.jsonl: {e.strerror or e}")

    def _report(self, watcher: Watcher, transitions: list[Transition]) -> None:
        verdicts = watcher.judge.verdicts()
        self.exporter.observe_transitions(transitions)
        self.exporter.set_verdicts(verdicts, watcher.clock())
        r = self.parts.responder
        quiet = not transitions and calm(verdicts) and (r is None or r.memory.incident is None)
        if not quiet and self.parts.trace is not None:
            try:
                self.parts.trace.flush()  # what led here is on disk before anything is done about it
            except OSError as e:
                self.exporter.write_errors.labels("trace.jsonl").inc()
                self._fault("trace", f"cannot write trace.jsonl: {e.strerror or e}")
        self._calm = quiet
        for tr in transitions:
            if tr.to_state in _UP and tr.from_state not in _UP:
                self._deadlines_due = True  # (back) in service: its processes, and their timeouts, may be new
            log_transition(self.cfg.engine.name, tr)
            self._event(transition_record(self.cfg.engine.name, self.url, tr, watcher.wall_of(tr.t)))
            if self.parts.gpu is not None and tr.to_state in (State.SUSPECT, State.FROZEN):
                self.parts.gpu.dense()  # the timeline around a freeze, sampled densely from the suspicion on

    def _gpu_samples(self) -> None:
        """New GPU samples to the metrics and the trace (power beside the page, for replay and for people)."""
        gpu, trace = self.parts.gpu, self.parts.trace
        if gpu is None:
            return
        fresh = [s for s in gpu.window(self._gpu_seen) if s.t > self._gpu_seen]
        for s in fresh:
            self.exporter.observe_gpu(s)
            if trace is not None:
                try:
                    trace.write_record({"kind": "gpu", **s.to_json()})
                except OSError as e:
                    self.exporter.write_errors.labels("trace.jsonl").inc()
                    self._fault("trace", f"cannot write trace.jsonl: {e.strerror or e}")
        if fresh:
            self._gpu_seen = max(s.t for s in fresh)

    def _event(self, record: dict[str, object]) -> None:
        self.exporter.observe_record(record)
        if (err := self.events.write(record)) is not None:
            self.exporter.write_errors.labels("events.jsonl").inc()
            if self.events.failures == 1 and "events" not in self._faults_alerted:
                self._faults_alerted.add("events")
                self.parts.submit(fault_alert(self.cfg, "events", f"cannot write events.jsonl: {err.strerror or err}",
                                              "", self._started))

    # -- evidence: the coordinator asks for stacks; checks go back to the judge, bundles to the incident --

    def _evidence(self, watcher: Watcher, transitions: list[Transition]) -> None:
        evidence, responder = self.parts.evidence, self.parts.responder
        if evidence is None:
            return
        now = watcher.clock()
        for tr in transitions:
            evidence.on_transition(tr, now)
        for engine in watcher.judge.wants_stacks(now):
            evidence.check(engine, "looking at the stacks again", now)
        for out in evidence.collect(now):
            self._event({"time": iso(self.clock.wall()), "stack": self.cfg.engine.name, **out.event})
            if out.observation is not None:
                fed = watcher.feed(out.observation)
                self._report(watcher, fed)
                for tr in fed:
                    evidence.on_transition(tr, watcher.clock())
            if responder is not None and out.incident is not None:
                i = out.incident
                responder.evidence(i.engine, i.decision, i.bundle, i.details, final=i.final, incident=i.incident)

    def _bundle(self, incident: Incident) -> None:
        """An incident opened: its bundle, asked of the evidence stage (none when capture is off)."""
        if self.parts.evidence is not None and self.parts.watcher is not None:
            w = self.parts.watcher
            self.parts.evidence.bundle(incident.engine, State(incident.kind.value), incident.id, incident.reason,
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
        self._event({"time": iso(self.clock.wall()), "stack": self.cfg.engine.name, **record})

    def _respond(self, watcher: Watcher) -> None:
        """The act stage: the incident machine sees this pass's verdicts (this node's own, and overlaid with the
        other nodes' views), then the heartbeat, the gauges and status.json."""
        responder = self.parts.responder
        if responder is None:
            return
        now = watcher.clock()
        local = verdicts = watcher.judge.verdicts()
        views = self.parts.nodes.views() if self.parts.nodes is not None else []
        if self.parts.nodes is not None:  # a rank lost on another node is down; a node not seen makes it blind
            for v in self.parts.nodes.changes(views):
                log.warning("node %s: %s: %s", v.node, v.status, v.reason)
                self._event({"time": iso(self.clock.wall()), "stack": self.cfg.engine.name, "event": "node_state",
                             "node": v.node, "state": v.status, "reason": v.reason})
            verdicts = overlay(local, views)
            self.exporter.set_overlaid(verdicts, local, now)  # /readyz and /livez see the other nodes
        responder.sight(local, views, now)
        responder.step(verdicts, now)
        if self.parts.heartbeat is not None:  # only a pass that saw the engine: its page read, no verdict blind
            seen = watcher.judge.last_scrape_ok and bool(verdicts) and all(v.state != State.BLIND for v in verdicts)
            self.parts.heartbeat.beat(now, seen)
        status = {**responder.status(self.clock.wall()), "blind": responder.blind_status()}
        self.exporter.set_response(status)
        if self._deadlines_due or now - self._deadlines_read >= DEADLINES_EVERY:
            self._read_deadlines()
        self.status_file.update(verdicts, status, self._deadlines, now, now, self.clock.wall())

    def _read_deadlines(self) -> None:
        """The engine's own timeouts against our confirmation time: warned at start and when the warning changes."""
        before = self._deadlines and self._deadlines.get("warning")
        self._deadlines_read, self._deadlines_due = self.clock.mono(), False
        try:
            self._deadlines = read_deadlines(self.cfg, self.url).as_dict()
        except Exception as e:  # reading /proc must not stop the watch
            log.warning("cannot read the engine's timeouts: %s: %s", type(e).__name__, e)
            return
        if self._deadlines["warning"] and self._deadlines["warning"] != before:
            log.warning("deadline: %s", self._deadlines["warning"])
