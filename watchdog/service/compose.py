"""The composition root of ``watchdog run``: every edge the daemon's pass uses, built once for a config.

`compose` builds, in this order: the trace writer; the watcher (scrape and judge) on the daemon's one HTTP transport
to the engine; one SSH link per ``[[nodes]]`` entry, shared by the liveness watch, the capture and the restart; the
GPU monitor; the evidence stage (investigator, its runner thread, the coordinator); the act stage (alert dispatcher,
dead-man heartbeat, restarter with a runner per node, recovery runner, responder). `Parts.close` ends them in the
reverse order: threads first, queued alerts given a few seconds, the links and the transport last. Nothing here
decides anything; the daemon (`watchdog.service.daemon`) runs the pass over these parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from watchdog.act.alerts import Alert, Dispatcher, build_dispatcher
from watchdog.act.heartbeat import Heartbeat
from watchdog.act.respond import Bundle, Responder
from watchdog.act.restart import RecoveryRunner, Restarter, Runner
from watchdog.act.shm_sweep import sweepers
from watchdog.config.load import Config, Secret
from watchdog.config.restart_plan import describe
from watchdog.evidence.bundle.coordinator import EvidenceCoordinator
from watchdog.evidence.bundle.investigate import EvidenceRunner, Investigator
from watchdog.evidence.gpu.nvml import GpuMonitor, NvmlSource
from watchdog.host.run import LocalRunner
from watchdog.nodes.remote import RemoteEvidence, node_runners
from watchdog.nodes.transport import NodeLink, close_links, open_links
from watchdog.nodes.watch import NodeWatch
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.scrape.probe import generate_once
from watchdog.service.trace import TraceWriter
from watchdog.service.watcher import ObservationSink, Watcher, build_watcher

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Clock:
    """The one clock of a daemon: ``mono`` for intervals and the judge, ``wall`` for people and files."""

    mono: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the daemon hands its parts: where observations, act events and bundle requests go."""

    count: ObservationSink  # every observation, to the metrics
    trace: ObservationSink  # every observation, to trace.jsonl (when there is one)
    event: Callable[[dict[str, Any]], None]  # an act event, to events.jsonl and the metrics
    bundle: Bundle  # an incident opened: ask the evidence stage for its bundle


@dataclass(slots=True)
class Parts:
    """The daemon's edges; None where the config (or ``--once``) has none."""

    watcher: Watcher | None = None
    trace: TraceWriter | None = None
    links: dict[str, NodeLink] = field(default_factory=dict)
    gpu: GpuMonitor | None = None
    nodes: NodeWatch | None = None  # [[nodes]]: every other node's ranks, for the verdicts
    remote: RemoteEvidence | None = None  # [[nodes]]: the other nodes' evidence
    runner: EvidenceRunner | None = None
    evidence: EvidenceCoordinator | None = None
    alerts: Dispatcher | None = None
    heartbeat: Heartbeat | None = None
    recovery: RecoveryRunner | None = None
    responder: Responder | None = None

    def submit(self, alert: Alert) -> None:
        if self.alerts is not None:
            self.alerts.submit(alert)
        else:
            log.debug("no alert sink configured: %s for incident %s not sent", alert.event, alert.incident_id)

    def delivering(self) -> list[tuple[str, str, bool]]:
        """Each alert sink's (name, kind, last alert delivered): the exporter's watchdog_alert_sink_delivering."""
        return self.alerts.delivering() if self.alerts is not None else []

    def close(self) -> None:
        """Every part ended, each in its own guard: one that fails to close does not keep the others open."""
        enders: list[Callable[[], object]] = []
        if self.runner is not None:
            enders.append(self.runner.stop)
        if self.gpu is not None:
            enders.append(self.gpu.stop)
        if self.recovery is not None:
            enders.append(self.recovery.stop)
        if self.alerts is not None:
            alerts = self.alerts
            enders.append(lambda: alerts.close(timeout=5.0))  # queued alerts get a few seconds to go
        if self.heartbeat is not None:
            enders.append(self.heartbeat.close)
        if self.nodes is not None:
            enders.append(self.nodes.close)
        links = self.links
        enders.append(lambda: close_links(links))
        if self.trace is not None:
            enders.append(self.trace.close)
        for end in enders:
            try:
                end()
            except Exception:  # closing must go on to the next part
                log.exception("closing a part of the watchdog failed")


def compose(cfg: Config, state_dir: Path, http: EngineHTTP, hooks: Hooks, clock: Clock, once: bool) -> Parts:
    """The parts for ``cfg``. ``once`` (``watchdog run --once``): the watcher and trace only, nothing that acts. A
    part that cannot be built (a secret file missing) closes those built before it, then raises."""
    parts = Parts()
    try:
        _build(parts, cfg, state_dir, http, hooks, clock, once)
    except BaseException:
        parts.close()
        raise
    return parts


def _build(parts: Parts, cfg: Config, state_dir: Path, http: EngineHTTP, hooks: Hooks, clock: Clock,
           once: bool) -> None:
    if cfg.state.trace_max_bytes:
        parts.trace = TraceWriter(state_dir / "trace.jsonl", cfg.state.trace_max_bytes, {"url": http.base})
    sinks = [hooks.count, *([hooks.trace] if parts.trace is not None else [])]
    parts.watcher = watcher = build_watcher(cfg, http, sinks, clock.mono, clock.wall)
    if once:
        return
    parts.links = open_links(cfg.nodes)  # one connection per node, for liveness, capture and restart
    if cfg.gpu.enabled:
        g = cfg.gpu
        parts.gpu = GpuMonitor(NvmlSource(), g.interval, g.dense_interval, g.dense_for, g.keep_seconds)
        if parts.gpu.start():
            parts.gpu = None  # said once by the monitor: no GPU here, and nothing else happens
    if cfg.nodes:
        parts.nodes = NodeWatch(cfg.nodes, parts.links, clock.mono)
    if cfg.capture.enabled:
        parts.remote = RemoteEvidence(cfg, parts.links, clock.wall) if cfg.nodes else None
        investigator = Investigator(cfg, http, gpu=parts.gpu, others=parts.remote,
                                    reading=lambda: watcher.page)  # the page the judge read last
        for problem in investigator.preflight():
            log.warning("evidence capture: %s", problem)
        parts.runner = EvidenceRunner(investigator, clock.mono)
        parts.evidence = EvidenceCoordinator(parts.runner, cfg.judge.stall_window)
    _act_stage(parts, cfg, state_dir, http, hooks, clock)


def _act_stage(parts: Parts, cfg: Config, state_dir: Path, http: EngineHTTP, hooks: Hooks, clock: Clock) -> None:
    """Alerts, heartbeat, restarter, recovery and the responder that runs the incident machine's commands."""
    parts.alerts = build_dispatcher(cfg, state_dir / "alerts.jsonl")
    a = cfg.alerts
    parts.heartbeat = Heartbeat(Secret(a.heartbeat_url) if a.heartbeat_url else cfg.secret(
        "alerts.heartbeat_url", a.heartbeat_url_env, a.heartbeat_url_file), a.heartbeat_interval)
    # a step on another node runs there, through its agent (watchdog.nodes.remote.SshRunner), so do that node's
    # pre-start hook and /dev/shm check (the node's one shared link for both)
    runners: dict[str, Runner] | None = {"local": LocalRunner(), **node_runners(parts.links)} if cfg.nodes else None
    restarter = (Restarter(cfg.restart, runners, clock.mono, cfg.nodes, sweepers(cfg, parts.links), clock.wall)
                 if cfg.restart.steps else None)

    def generate() -> tuple[bool, bool, str]:
        ok, answered, detail, _model = generate_once(http, cfg.probe.timeout, cfg.probe.model)
        return ok, answered, detail

    parts.recovery = RecoveryRunner(restarter, generate, cfg.probe.retry, clock.wall, clock=clock.mono)
    plan = describe(cfg.restart, cfg.nodes) if cfg.restart.steps else []
    parts.responder = Responder(cfg, state_dir, parts, parts.recovery, hooks.event, plan, clock.wall,
                                hooks.bundle if parts.evidence is not None else None)
    if cfg.restart.dry_run:
        log.warning("dry run: restarts are described in events, never run")
    elif not cfg.restart.steps:
        log.info("no restart steps configured: incidents are alerted and recorded, never acted on")
    parts.responder.resume()
