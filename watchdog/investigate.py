"""The evidence stage end to end: find the processes, capture their stacks, assess them, write the bundle.

Used by `watchdog dump` (on demand) and by the daemon (on suspicion and on a freeze).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from watchdog.bundle import Incident, new_id, prune, write_bundle
from watchdog.capture import Capture, Capturer, find_pyspy
from watchdog.config import Config
from watchdog.context import LogSource, fetch_metrics_page, gather
from watchdog.discover import EngineProcess, discover
from watchdog.evidence import Findings, assess
from watchdog.scrape import base_url

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Evidence:
    capture: Capture
    findings: Findings
    seconds: float


class Investigator:
    def __init__(self, cfg: Config, finder: Callable[[], list[EngineProcess]] | None = None,
                 capturer: Capturer | None = None) -> None:
        self.cfg = cfg
        c = cfg.capture
        self.base = base_url(cfg.engine.url)
        self.finder = finder or (lambda: discover(self.base, c.process_prefix, c.title_filter))
        self.capturer = capturer or Capturer(find_pyspy(c.pyspy), c.timeout, c.native, c.locals)
        self.incidents_dir = Path(cfg.state.dir) / "incidents"

    def investigate(self, work_pending: bool | None) -> Evidence:
        t0 = time.monotonic()
        processes = self.finder()
        capture = self.capturer.capture(processes, self.cfg.capture.rounds, self.cfg.capture.gap)
        findings = assess(capture, work_pending)
        seconds = time.monotonic() - t0
        log.info("stacks of %d processes in %.1fs: %s (%s)", len(processes), seconds, findings.decision.value,
                 findings.reason)
        return Evidence(capture, findings, seconds)

    def write(self, engine: str, state: str, reason: str, evidence: Evidence, root: Path | None = None) -> Path:
        c = self.cfg.capture
        page, problem = fetch_metrics_page(self.base)
        context = gather(self.base, page, LogSource(c.log_file, c.journal_unit, c.docker_container, c.log_lines),
                         [p.pid for p in evidence.capture.processes if p.role == "engine_core"],
                         self.capturer.pyspy)
        if problem:
            context = replace(context, problems=(*context.problems, problem))
        wall = time.time()
        inc = Incident(new_id(engine, state, wall), engine, state, reason, self.base, wall)
        root = root or self.incidents_dir
        path = write_bundle(root, inc, evidence.capture, evidence.findings, context)
        removed = prune(root, self.cfg.incidents.max_count, self.cfg.incidents.max_bytes)
        if removed:
            log.info("incident retention removed %s", ", ".join(removed))
        return path
