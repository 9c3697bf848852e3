"""The evidence stage end to end: find the processes, capture their stacks, assess them, write the bundle.

Used by `watchdog dump` (on demand) and by the daemon (on suspicion and on a freeze).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from watchdog.config.load import Config
from watchdog.core.processes import LOCAL, Capture, EngineProcess, Problem
from watchdog.core.roles import Role
from watchdog.core.types import PageReading
from watchdog.evidence.bundle.write import BundleError, BundleHeader, prune, said_of, write_bundle
from watchdog.evidence.collect.capture import MISSING_HINT, PTRACE_HINT, Capturer, find_pyspy
from watchdog.evidence.collect.context import Context, LogSource, fetch_metrics_page, gather, installed_versions
from watchdog.evidence.collect.discover import discover
from watchdog.evidence.collect.ring import read_engine_rings
from watchdog.evidence.explain.findings import Findings, PageWork, assess
from watchdog.evidence.gpu.gather import gather_gpu
from watchdog.evidence.gpu.nvml import GpuMonitor
from watchdog.host.ptrace import attach_forbidden
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.scrape.page import PageError, read_page

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Evidence:
    capture: Capture
    findings: Findings
    seconds: float
    vllm: str = ""  # the engine's vLLM version from its own site-packages ("" when not read): known hangs' fixes


class OtherNodes(Protocol):
    """The other nodes' share of the evidence (`watchdog.nodes.remote.RemoteEvidence`, handed in from above)."""

    def capture_with(self, local: Callable[[], Capture]) -> Capture:
        """The local capture and every other node's, taken side by side and merged into one."""
        ...

    def context(self, base: Context) -> Context:
        """``base`` with each other node's context (its log tail, versions, problems) added."""
        ...


class Investigator:
    """``others``: the other nodes' evidence when there are ``[[nodes]]`` (None: this node alone). ``reading``: the
    page as the judge last read it (the daemon's watcher's, `Watcher.page`; None when it could not be read), whose
    running/waiting the assessment weighs; without it the page is read here."""

    def __init__(self, cfg: Config, http: EngineHTTP, finder: Callable[[], list[EngineProcess]] | None = None,
                 capturer: Capturer | None = None, gpu: GpuMonitor | None = None,
                 others: OtherNodes | None = None,
                 survivors: Callable[[], list[EngineProcess]] | None = None,
                 reading: Callable[[], PageReading | None] | None = None) -> None:
        self.cfg, self.http, self.gpu = cfg, http, gpu
        self.reading = reading or self._read_page
        self._given_reading = reading is not None  # the judge's page: read here only when it has none yet
        c = cfg.capture
        self.base = http.base
        self.finder = finder or (lambda: discover(self.base, c.process_prefix, c.title_filter,
                                                  container=c.docker_container))
        # a down engine's processes still alive: only under its own port or container, never the host's other titles
        self.survivors = survivors or (lambda: discover(self.base, c.process_prefix, c.title_filter,
                                                        container=c.docker_container, anywhere=False))
        self.capturer = capturer or Capturer(find_pyspy(c.pyspy), c.timeout, c.native, c.locals)
        self.incidents_dir = Path(cfg.state.dir) / "incidents"
        self.remote = others  # [[nodes]]: their stacks and context too

    def preflight(self) -> list[str]:
        """What would stop a capture, known before any incident: say it at start, not at 3 a.m."""
        problems = []
        if self.capturer.pyspy is None:
            problems.append(MISSING_HINT)
        if attach_forbidden():
            problems.append(PTRACE_HINT)
        return problems

    def page_work(self, engine: str) -> PageWork | None:
        """The page's running/waiting for ``engine`` (the one engine when unnamed); None if it cannot be read."""
        page = self.reading() or (self._read_page() if self._given_reading else None)
        if page is None:
            return None
        engines = page.engines
        e = engines.get(engine) or (next(iter(engines.values())) if len(engines) == 1 else None)
        return PageWork(e.running, e.waiting) if e is not None else None

    def _read_page(self) -> PageReading | None:
        """The page now, for a caller with no reading of its own."""
        text, problem = fetch_metrics_page(self.http)
        if problem or not text:
            return None
        try:
            return read_page(text)
        except PageError:
            return None

    def investigate(self, work_pending: bool | None, engine: str = "", down: bool = False) -> Evidence:
        """The stacks of the engine's processes. ``down``: of those still alive under its port or container (none:
        no capture at all, the bundle is its log and GPUs)."""
        t0 = time.monotonic()
        page = None if down else self.page_work(engine)  # at suspicion, before the gap: livelock, admission stall
        processes = self.survivors() if down else self.finder()
        if down and not processes and self.remote is None:
            capture = Capture((), (), (), {"rounds": 0, "survivors": "none: every engine process had exited"})
            return Evidence(capture, assess(capture, None), time.monotonic() - t0)

        def local() -> Capture:
            taken = self.capturer.capture(processes, self.cfg.capture.rounds, self.cfg.capture.gap,
                                          native_pids=self._gpu_holders(processes))
            # the broadcast ring's flags, read once after the rounds, never written (docs/ring.md)
            return replace(taken, rings=read_engine_rings(taken.processes, self.capturer.clock()))

        # every other node's capture runs beside ours, merged into one (watchdog.nodes.remote)
        capture = self.remote.capture_with(local) if self.remote is not None else local()
        findings = assess(capture, work_pending, page, engine)
        engines = [p.pid for p in processes if p.role == Role.ENGINE_CORE and p.node == LOCAL]
        vllm = installed_versions(engines, None).get("vllm", "")  # /proc maps only, no subprocess
        seconds = time.monotonic() - t0
        nodes = len({p.node for p in capture.processes})
        log.info("stacks of %d processes on %d node(s) in %.1fs: %s (%s)", len(capture.processes), nodes, seconds,
                 findings.decision.value, findings.reason)
        return Evidence(capture, findings, seconds, vllm)

    def _gpu_holders(self, processes: list[EngineProcess]) -> frozenset[int]:
        """Engine processes holding a GPU (NVML's last minute), whose waits only native frames show."""
        if self.gpu is None or not self.cfg.gpu.native or self.cfg.capture.native:
            return frozenset()
        held = {proc.pid for s in self.gpu.window(self.gpu.clock() - 60.0) for proc in s.procs}
        return frozenset(p.pid for p in processes if p.pid in held)

    def write(self, incident: str, engine: str, state: str, reason: str, evidence: Evidence,
              root: Path | None = None, stalled_since: float | None = None) -> Path:
        """The bundle of incident ``incident`` (its one id names the directory). ``stalled_since``: wall time of
        the last progress the judge saw, the start of the window the GPUs' states are read over."""
        c = self.cfg.capture
        page, problem = fetch_metrics_page(self.http)
        cores = [p.pid for p in evidence.capture.processes if p.role == Role.ENGINE_CORE and p.node == LOCAL]
        context = gather(self.http, page, LogSource(c.log_file, c.journal_unit, c.docker_container, c.log_lines),
                         cores, self.capturer.pyspy)
        if problem:
            context = replace(context, problems=(*context.problems, Problem(problem)))
        if self.remote is not None:
            context = self.remote.context(context)
        wall = time.time()
        inc = BundleHeader(incident, engine, state, reason, self.base, wall)
        root = root or self.incidents_dir
        # on a GPU host: NVML around the freeze, RAS, every rank's Flight Recorder (bounded), before any restart; a
        # down engine's GPUs from the last minute (no Flight Recorder: its ranks are gone)
        since = wall - (self.cfg.judge.stall_window if state != "down" else 60.0) - evidence.seconds
        gpu = (gather_gpu(evidence.capture.processes, self.gpu, self.cfg.gpu, since, freeze=state != "down",
                          now=wall, stalled_since=stalled_since) if self.gpu is not None else None)
        path = write_bundle(root, inc, evidence.capture, evidence.findings, context, gpu,
                            self.cfg.alerts.runbook_base)
        removed = prune(root, self.cfg.incidents.max_count, self.cfg.incidents.max_bytes)
        if removed:
            log.info("incident retention removed %s", ", ".join(removed))
        return path


@dataclass(frozen=True, slots=True)
class EvidenceJob:
    engine: str
    state: str
    reason: str
    bundle: bool  # write an incident bundle (a freeze, a down engine), or only check the stacks (a suspicion)
    reuse_after: float  # a capture of this engine started after this (monotonic) may serve instead of a new one
    incident: str = ""  # the incident whose bundle this is (bundle jobs only)
    stalled_since: float | None = None  # wall time of the last progress seen (bundle jobs): the GPUs' window


@dataclass(frozen=True, slots=True)
class EvidenceDone:
    job: EvidenceJob
    started: float  # monotonic, when the capture that serves this job began
    evidence: Evidence | None
    bundle: Path | None
    error: str = ""
    said: tuple[str, str] = ("", "")  # the bundle's (headline, runbook name): its GPU evidence may say more


class EvidenceRunner:
    """Runs investigations one at a time in a background thread, so the watcher keeps scraping meanwhile."""

    def __init__(self, investigator: Investigator, clock: Callable[[], float] = time.monotonic) -> None:
        self.investigator = investigator
        self.clock = clock
        self._jobs: queue.Queue[EvidenceJob | None] = queue.Queue()
        self._done: queue.Queue[EvidenceDone] = queue.Queue()
        self._latest: dict[str, tuple[float, Evidence]] = {}
        self._thread = threading.Thread(target=self._work, name="evidence", daemon=True)
        self._thread.start()

    def request(self, job: EvidenceJob) -> None:
        self._jobs.put(job)

    def poll(self) -> list[EvidenceDone]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def stop(self, timeout: float = 30.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._done.put(self._run(job))
            except Exception as e:  # the evidence stage must never take the watcher down
                log.exception("evidence capture failed")
                self._done.put(EvidenceDone(job, self.clock(), None, None, f"{type(e).__name__}: {e}"))

    def _run(self, job: EvidenceJob) -> EvidenceDone:
        latest = self._latest.get(job.engine)
        if job.state == "down":  # what is left of it now (a capture of the engine alive would say nothing of this)
            started = self.clock()
            evidence = self.investigator.investigate(None, job.engine, down=True)
        elif latest is not None and latest[0] >= job.reuse_after:
            started, evidence = latest
        else:
            started = self.clock()
            evidence = self.investigator.investigate(work_pending=True, engine=job.engine)
            self._latest[job.engine] = (started, evidence)
        if not job.bundle:
            return EvidenceDone(job, started, evidence, None)
        try:
            path = self.investigator.write(job.incident, job.engine, job.state, job.reason, evidence,
                                           stalled_since=job.stalled_since)
        except BundleError as e:
            log.error("%s", e)
            return EvidenceDone(job, started, evidence, None, str(e))
        said = said_of(path)
        log.warning("incident bundle written: %s: %s (runbook %s)", path, *said)
        return EvidenceDone(job, started, evidence, path, said=said)
