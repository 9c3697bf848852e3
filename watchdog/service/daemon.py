"""The watcher loop: scrape -> judge -> (probe) -> report, and the long-running service around it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO, Protocol

from watchdog.act.assemble import Act
from watchdog.act.state import iso, save_status
from watchdog.config.load import Config
from watchdog.evidence.discover import server_for_port
from watchdog.evidence.findings import Decision
from watchdog.evidence.investigate import EvidenceJob, EvidenceRunner, Investigator
from watchdog.judge.judge import Judge
from watchdog.scrape.fetch import MetricsFetcher
from watchdog.scrape.probe import Prober
from watchdog.scrape.trace import TraceWriter
from watchdog.service.exporter import Exporter
from watchdog.service.sdnotify import Notifier
from watchdog.types import (
    Observation,
    ProbeFinished,
    ProbeStarted,
    Scrape,
    ServerProcess,
    StackEvidence,
    State,
    Transition,
    Verdict,
    base_url,
)

log = logging.getLogger(__name__)

STATUS_EVERY = 5.0  # seconds between rewrites of an unchanged status.json

_LOUD = {State.FROZEN, State.DOWN, State.BLIND, State.SUSPECT}


class Fetcher(Protocol):
    def scrape(self) -> Scrape: ...


class ServerFinder(Protocol):
    def __call__(self) -> ServerProcess: ...


class ProbeSender(Protocol):
    @property
    def in_flight(self) -> bool: ...
    def start(self) -> ProbeStarted: ...
    def poll(self) -> ProbeFinished | None: ...
    def wait(self, timeout: float) -> None: ...


ObservationSink = Callable[[Observation, float], None]


class Watcher:
    """One tick at a time: collect a finished probe, scrape, judge, start a probe if the judge wants one."""

    def __init__(
        self,
        fetcher: Fetcher,
        judge: Judge,
        prober: ProbeSender | None = None,
        sinks: list[ObservationSink] | None = None,
        find_server: ServerFinder | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.fetcher, self.judge, self.prober = fetcher, judge, prober
        self.find_server = find_server
        self.sinks = sinks or []
        self.clock, self.wall = clock, wall

    def tick(self) -> list[Transition]:
        out: list[Transition] = []
        if self.prober is not None and (done := self.prober.poll()) is not None:
            out += self.feed(done)
        scrape = self.fetcher.scrape()
        if self.find_server is not None and scrape.error_kind in ("refused", "unreachable"):
            out += self.feed(self.find_server())  # the port is closed: is a server for it booting?
        out += self.feed(scrape)
        if self.prober is not None and self.judge.wants_probe(self.clock()):
            out += self.feed(self.prober.start())
        return out

    def wall_of(self, t: float) -> float:
        return self.wall() - (self.clock() - t)

    def feed(self, obs: Observation) -> list[Transition]:
        wall = obs.wall if isinstance(obs, Scrape) else self.wall_of(obs.t)
        for sink in self.sinks:
            sink(obs, wall)
        return self.judge.observe(obs)


def build_watcher(cfg: Config, sinks: list[ObservationSink] | None = None) -> Watcher:
    fetcher = MetricsFetcher(cfg.engine.url, cfg.scrape.limits())
    prober = Prober(cfg.engine.url, cfg.probe.timeout, cfg.probe.model, cfg.api_key()) if cfg.probe.enabled else None
    clock = time.monotonic

    def find_server() -> ServerProcess:
        tree = server_for_port(cfg.engine.url)
        if tree is None:
            return ServerProcess(clock(), None)
        return ServerProcess(clock(), tree.pid, tree.started, tree.titles)

    return Watcher(fetcher, Judge(cfg.thresholds()), prober, sinks, find_server, clock=clock)


def transition_record(cfg: Config, tr: Transition, wall: float) -> dict[str, object]:
    return {
        "time": iso(wall),
        "event": "transition",
        "stack": cfg.engine.name,
        "url": base_url(cfg.engine.url),
        "engine": tr.engine,
        "from": tr.from_state.value if tr.from_state else None,
        "to": tr.to_state.value,
        "reason": tr.reason,
    }


def log_transition(cfg: Config, tr: Transition) -> None:
    level = logging.WARNING if tr.to_state in _LOUD else logging.INFO
    before = tr.from_state.value if tr.from_state else "unknown"
    log.log(level, "%s engine %s: %s -> %s: %s", cfg.engine.name, tr.engine, before, tr.to_state.value, tr.reason,
            extra={"ENGINE": tr.engine, "STATE": tr.to_state.value, "FROM_STATE": before, "STACK": cfg.engine.name})


def status_line(verdicts: list[Verdict]) -> str:
    if not verdicts:
        return "no verdict yet"
    return "; ".join(f"engine {v.engine}: {v.state.value}" for v in verdicts)


class Daemon:
    """``watchdog run``: the watcher every interval until SIGTERM/SIGINT, with events, trace and metrics."""

    def __init__(self, cfg: Config, state_dir: Path, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.state_dir = state_dir
        self.notifier = notifier or Notifier()
        self.exporter = Exporter()
        self._events: IO[str] | None = None
        self._trace: TraceWriter | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stop_signal: int | None = None
        self.evidence: EvidenceRunner | None = None
        self._checking: set[str] = set()  # engines whose stacks are being checked on suspicion
        self._bundled: set[str] = set()  # engines whose current freeze already has (or awaits) a bundle
        self.act: Act | None = None
        self._status_seen: object = None
        self._status_written = 0.0

    def run(self, once: bool = False) -> int:
        self._open_state()
        if self.cfg.exporter.port and not once:
            self.exporter.serve(self.cfg.exporter.listen, self.cfg.exporter.port)
        sinks: list[ObservationSink] = [self._count]
        if self._trace is not None:
            sinks.append(self._trace.write)
        watcher = build_watcher(self.cfg, sinks)
        if self.cfg.capture.enabled and not once:
            investigator = Investigator(self.cfg)
            for problem in investigator.preflight():
                log.warning("evidence capture: %s", problem)
            self.evidence = EvidenceRunner(investigator)
        if not once:
            self.act = Act(self.cfg, self.state_dir, self._act_event)
        self._install_signals()
        log.info("watching %s every %gs (suspect after %gs, frozen after %gs); state in %s",
                 watcher.fetcher.url if isinstance(watcher.fetcher, MetricsFetcher) else self.cfg.engine.url,
                 self.cfg.scrape.interval, self.cfg.judge.suspect_after, self.cfg.judge.stall_window,
                 self.state_dir)
        ready = False
        try:
            while self._stop_signal is None:
                started = time.monotonic()
                self._report(watcher, watcher.tick())
                self._collect_evidence(watcher)
                self._respond(watcher)
                if not ready:
                    self.notifier.ready(status_line(watcher.judge.verdicts()))
                    ready = True
                else:
                    self.notifier.status(status_line(watcher.judge.verdicts()))
                if once:
                    if watcher.prober is not None and watcher.prober.in_flight:
                        watcher.prober.wait(self.cfg.probe.timeout + 1)
                        self._report(watcher, watcher.tick())
                    break
                self._sleep(started + self.cfg.scrape.interval - time.monotonic())
        finally:
            self.notifier.stopping()
            if self.evidence is not None:
                self.evidence.stop()
            if self.act is not None:
                self.act.close()
            self._restore_signals()
            self._close_state()
        if self._stop_signal is not None:
            log.info("stopped by %s", signal.Signals(self._stop_signal).name)
        return 0

    # -- reporting -------------------------------------------------------------------------------------

    def _count(self, obs: Observation, _wall: float) -> None:
        if isinstance(obs, Scrape):
            self.exporter.observe_scrape(obs)
        elif isinstance(obs, ProbeFinished):
            self.exporter.observe_probe(obs)

    def _report(self, watcher: Watcher, transitions: list[Transition]) -> None:
        self.exporter.observe_transitions(transitions)
        self.exporter.set_verdicts(watcher.judge.verdicts(), watcher.clock())
        for tr in transitions:
            log_transition(self.cfg, tr)
            self._event(transition_record(self.cfg, tr, watcher.wall_of(tr.t)))
            self._ask_for_evidence(watcher, tr)

    def _event(self, record: dict[str, object]) -> None:
        if self._events is not None:
            self._events.write(json.dumps(record) + "\n")
            self._events.flush()

    # -- evidence: stacks confirm or clear a suspicion; a freeze gets one bundle ---------------------------

    def _ask_for_evidence(self, watcher: Watcher, tr: Transition) -> None:
        if tr.to_state not in (State.SUSPECT, State.FROZEN):
            self._checking.discard(tr.engine)
            self._bundled.discard(tr.engine)
            return
        if self.evidence is None:
            return
        now = watcher.clock()
        if tr.to_state == State.SUSPECT and tr.engine not in self._checking:
            self._checking.add(tr.engine)
            self.evidence.request(EvidenceJob(tr.engine, tr.to_state.value, tr.reason, False, now))
        elif tr.to_state == State.FROZEN and tr.engine not in self._bundled:
            self._bundled.add(tr.engine)
            # the capture that confirmed (or was taken during) this suspicion is this freeze's evidence
            self.evidence.request(EvidenceJob(tr.engine, tr.to_state.value, tr.reason, True,
                                              now - self.cfg.judge.stall_window))

    def _collect_evidence(self, watcher: Watcher) -> None:
        if self.evidence is None:
            return
        for done in self.evidence.poll():
            engine, f = done.job.engine, done.evidence.findings if done.evidence else None
            base: dict[str, object] = {"time": iso(time.time()), "stack": self.cfg.engine.name, "engine": engine}
            if f is None:
                self._checking.discard(engine)
                self._event({**base, "event": "evidence_failed", "error": done.error})
                if self.act is not None and done.job.bundle:
                    self.act.responder.evidence(engine, None, None, {"error": done.error})
                continue
            summary = {"decision": f.decision.value, "reason": f.reason, "culprit": f.cross_rank.culprit,
                       "poll_parking": f.hypothesis.status.value, "complete": f.complete}
            if not done.job.bundle:
                self._checking.discard(engine)
                self._event({**base, "event": "evidence_checked", **summary})
                stuck = None if f.decision == Decision.UNDECIDED else f.decision == Decision.STUCK
                obs = StackEvidence(watcher.clock(), engine, stuck, f.reason, captured_at=done.started)
                self._report(watcher, watcher.feed(obs))
            else:
                bundle = str(done.bundle) if done.bundle else None
                self._event({**base, "event": "evidence_captured", "bundle": bundle, "error": done.error or None,
                             **summary})
            if self.act is not None:
                details = {k: v for k, v in summary.items() if k != "decision"}
                if done.error:
                    details["error"] = done.error
                self.act.responder.evidence(engine, f.decision.value, str(done.bundle) if done.bundle else None,
                                        details, final=done.job.bundle)

    # -- act: incidents, alerts, restarts --------------------------------------------------------------------

    def _act_event(self, record: dict[str, object]) -> None:
        self.exporter.observe_event(str(record["event"]))
        self._event({"time": iso(time.time()), "stack": self.cfg.engine.name, **record})

    def _respond(self, watcher: Watcher) -> None:
        if self.act is None:
            return
        verdicts = watcher.judge.verdicts()
        status = self.act.step(verdicts, watcher.clock())
        self.exporter.set_response(status)
        # written when something an operator would see changed, else every few seconds (`status` tells a stale file)
        seen = (tuple((v.engine, v.state) for v in verdicts), repr(status["incident"]), status["paused"],
                status["budget_left"], status["recovery"] and status["recovery"]["phase"])
        now = time.monotonic()
        if seen == self._status_seen and now - self._status_written < STATUS_EVERY:
            return
        self._status_seen, self._status_written = seen, now
        status.update({"pid": os.getpid(), "time": time.time(), "stack": self.cfg.engine.name,
                       "url": base_url(self.cfg.engine.url), "interval": self.cfg.scrape.interval,
                       "engines": [{"engine": v.engine, "state": v.state.value, "reason": v.reason,
                                    "for_seconds": round(watcher.clock() - v.since, 1)} for v in verdicts]})
        try:
            save_status(self.state_dir, status)
        except OSError as e:
            log.warning("cannot write %s/status.json: %s", self.state_dir, e.strerror)

    def _open_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._events = open(self.state_dir / "events.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        if self.cfg.state.trace_max_bytes:
            self._trace = TraceWriter(self.state_dir / "trace.jsonl", self.cfg.state.trace_max_bytes,
                                      {"url": base_url(self.cfg.engine.url)})

    def _close_state(self) -> None:
        if self._events is not None:
            self._events.close()
        if self._trace is not None:
            self._trace.close()

    # -- signals through a self-pipe -------------------------------------------------------------------

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w)
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stop_signal = signum

    def _restore_signals(self) -> None:
        for s, handler in getattr(self, "_old_handlers", {}).items():
            signal.signal(s, handler)
        if self._wake_w >= 0:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _sleep(self, seconds: float) -> None:
        if seconds <= 0 or self._stop_signal is not None:
            return
        readable, _, _ = select.select([self._wake_r], [], [], seconds)
        if readable:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 512)
