"""The act stage assembled for one config: responder, blind incidents, recovery, alert sinks and the dead-man heartbeat.

The daemon calls `Act.step` once a pass with the judge's verdicts, hands over stack evidence as it arrives, and
closes it on the way out (queued alerts get a few seconds to go).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from watchdog.act.alerts import Alert, Dispatcher, build_dispatcher
from watchdog.act.heartbeat import Heartbeat
from watchdog.act.recovery import RecoveryRunner
from watchdog.act.respond import Bundle, Responder
from watchdog.act.restart import Restarter, RestartOutcome, Runner
from watchdog.act.shm_sweep import sweepers
from watchdog.config.load import Config, Secret
from watchdog.config.restart_plan import describe
from watchdog.core.types import Decision, State, Verdict, base_url, incident_id
from watchdog.host.run import LocalRunner
from watchdog.nodes.liveness import NodeView
from watchdog.nodes.remote import node_runners
from watchdog.nodes.transport import NodeLink
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.scrape.probe import generate_once

log = logging.getLogger(__name__)


class _NoAlerts:
    def submit(self, alert: Alert) -> None:
        log.debug("no alert sink configured: %s for incident %s not sent", alert.event, alert.incident_id)


class Act:
    def __init__(self, cfg: Config, state_dir: Path, event: Callable[[dict[str, Any]], None],
                 http: EngineHTTP, links: Mapping[str, NodeLink], bundle: Bundle | None = None) -> None:
        """``links``: one per ``[[nodes]]`` entry (`watchdog.nodes.transport.open_links`), shared with the other
        stages and closed by their owner; ``bundle(incident)``: asks the evidence stage for a freeze's or a down
        engine's bundle."""
        self.cfg = cfg
        self.alerts: Dispatcher | None = build_dispatcher(cfg)
        a = cfg.alerts
        hb_url = Secret(a.heartbeat_url) if a.heartbeat_url else cfg.secret(
            "alerts.heartbeat_url", a.heartbeat_url_env, a.heartbeat_url_file)
        self.heartbeat = Heartbeat(hb_url, a.heartbeat_interval)
        # a step on another node runs there, through its agent ([[nodes]]; watchdog.nodes.remote.SshRunner), so do
        # that node's pre-start hook and /dev/shm check (the node's one shared connection for both)
        runners: dict[str, Runner] | None = {"local": LocalRunner(), **node_runners(links)} if cfg.nodes else None
        restarter = Restarter(cfg.restart, runners, nodes=cfg.nodes,
                              sweepers=sweepers(cfg, links)) if cfg.restart.steps else None
        self.restarter = restarter

        def generate() -> tuple[bool, bool, str]:
            ok, answered, detail, _model = generate_once(http, cfg.probe.timeout, cfg.probe.model)
            return ok, answered, detail

        def restart(cancel: threading.Event) -> RestartOutcome:
            if restarter is None:
                raise RuntimeError("no restart steps configured")
            return restarter.run(cancel)

        self.recovery = RecoveryRunner(restart, generate, cfg.probe.retry)
        plan = describe(cfg.restart, cfg.nodes) if cfg.restart.steps else []
        self.responder = Responder(cfg, state_dir, self.alerts or _NoAlerts(), self.recovery, event, plan,
                                   bundle=bundle)
        if cfg.restart.dry_run:
            log.warning("dry run: restarts are described in events, never run")
        elif not cfg.restart.steps:
            log.info("no restart steps configured: incidents are alerted and recorded, never acted on")
        self.responder.resume()

    def step(self, verdicts: list[Verdict], mono: float, page_read: bool = True,
             local: Sequence[Verdict] | None = None, views: Sequence[NodeView] = ()) -> dict[str, Any]:
        """One pass: the blind incidents (``local``: this node's own verdicts under the other nodes' ``views``;
        default ``verdicts``), the policy, then the heartbeat (only if this pass saw the engine: its page read, no
        verdict blind; a freeze stays frozen while its page cannot be read); returns the status."""
        self.responder.sight(verdicts if local is None else local, views, mono)
        self.responder.step(verdicts, mono)
        self.heartbeat.beat(mono, page_read and bool(verdicts) and all(v.state != State.BLIND for v in verdicts))
        return {**self.responder.status(time.time()), "blind": self.responder.blind_status()}

    @property
    def settled(self) -> bool:
        """No incident, no recovery, all seen: a calm pass has nothing here to decide."""
        r = self.responder
        return r.memory.incident is None and r.recovery.progress is None and not r.watching

    @property
    def incident_open(self) -> bool:
        return self.responder.memory.incident is not None

    def stacks(self, engine: str, decision: Decision | None, bundle: str | None, details: dict[str, Any],
               final: bool, incident: str = "") -> None:
        """What the stacks said, for the engine's incident (a freeze or a down engine waits for its bundle; stacks
        may hold a freeze)."""
        self.responder.evidence(engine, decision, bundle, details, final=final, incident=incident)

    def fault(self, stage: str, error: str, where: str, started: float) -> None:
        """The watchdog's own fault: one alert per stage and watchdog life (the id is the same all that life)."""
        if self.alerts is None:
            return
        fid = incident_id(started, self.cfg.engine.name, "-", f"fault-{stage}", "0")
        self.alerts.submit(Alert("watchdog_fault", fid, "-", self.cfg.engine.name, base_url(self.cfg.engine.url),
                                 "watchdog_fault", f"the watchdog's {stage} stage failed: {error}",
                                 {"stage": stage, "error": error, "where": where[-2000:]}))

    def delivering(self) -> list[tuple[str, str, bool]]:
        """Each alert sink's (name, kind, last alert delivered): the exporter's watchdog_alert_sink_delivering."""
        return self.alerts.delivering() if self.alerts is not None else []

    def close(self) -> None:
        self.recovery.stop()
        if self.alerts is not None:
            self.alerts.close(timeout=5.0)
        self.heartbeat.close()
