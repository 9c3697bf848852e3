"""The restart and its proof: run the configured restart steps in order (`Restarter`), then prove the engine is
back with a real generation (`RecoveryRunner`, in the background while the watcher goes on scraping).

The commands and their order come from `watchdog.config.restart_plan` (pure; its docstring has the rules). A step's
timeout covers all its commands: each gets the time left in the step when it starts. ``Restarter.run`` runs the
plan group after group: a group is one command, or the same command on every node of a step with ``nodes``, run at
once (a thread per node, each bounded by its step's time); it stops after the first group with a failed command, a
failed stop included: starting over a half-stopped stack is worse than leaving it to a human. In a group every
node's command runs to its end even when another's failed (none is cut off mid-command), and the outcome names each
node that failed. One exception: before a transient unit's start, systemctl's "not loaded" (exit 5) from its stop
means nothing runs as it (the record's ``note`` says so), and the start goes on. The cancel event is checked between
groups, never mid-command. A command on this host runs through `watchdog.host.run` (its own session, its whole
process group ended on timeout); on another node, through that node's agent.

The /dev/shm check (``sweepers``, one per node) runs where `restart_plan.shm_check_at` puts it: after the last stop
step and before the first starting command. Each node reports the stale segments a dead engine left (``psm_*``,
``sem.mp-*`` no process has open or mapped) and removes them where configured; a check that fails is reported in
the step records and never fails the restart.

A failed command's error ends with what it printed last (docker's own stderr). A docker stop or restart gets
``--time`` N; when it took N s or more, docker's own events tell whether it had to kill, in the record's ``killed``.

The engine counts as back only when a ``max_tokens=1`` completion succeeds, tried every ``retry`` seconds until the
boot timeout (large checkpoints take tens of minutes); progress is logged every half minute and kept in
``progress`` for the status file and metrics.
"""

from __future__ import annotations

import logging
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from watchdog.act.incident_types import Phase, RecoveryJob
from watchdog.config.act import RestartSection
from watchdog.config.nodes import NodeSection
from watchdog.config.restart_plan import (
    SHM_SKIPPED,
    SYSTEMCTL_NOT_LOADED,
    PlannedCommand,
    argv_for,
    docker_time_given,
    groups,
    killed_note,
    output_said,
    plan,
    secs,
    shm_check_at,
)
from watchdog.core.processes import LOCAL
from watchdog.host.docker_cli import kills_argv
from watchdog.host.run import LocalRunner, RunResult

log = logging.getLogger(__name__)


class Runner(Protocol):
    """Runs one argv with a timeout; never raises for a command that fails or cannot start."""

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult: ...


@dataclass(frozen=True, slots=True)
class ShmReport:
    """One node's /dev/shm check: stale segments found (removed ones included) and removed, as (name, bytes)."""

    node: str
    stale: tuple[tuple[str, int], ...] = ()
    removed: tuple[tuple[str, int], ...] = ()
    in_use: int = 0  # segments some process still has open or mapped (never touched)
    error: str = ""  # listing or removing failed (said, never a failed restart)

    def record(self) -> dict[str, Any]:
        return {"node": self.node, "stale": [{"name": n, "bytes": b} for n, b in self.stale],
                "stale_bytes": sum(b for _, b in self.stale),
                "removed": [{"name": n, "bytes": b} for n, b in self.removed],
                "removed_bytes": sum(b for _, b in self.removed), "in_use": self.in_use, "error": self.error}


class Sweeper(Protocol):
    """Lists (and, if its node is configured so, removes) the stale /dev/shm segments of one node; never raises."""

    def __call__(self) -> ShmReport: ...


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    ok: bool
    results: tuple[RunResult, ...]  # one per command run, in order
    failed: str = ""  # the description of the command that failed (cancelled: of the one not run)
    duration: float = 0.0
    cancelled: bool = False
    steps: tuple[dict[str, Any], ...] = ()  # what ran, in order, for events: commands and the /dev/shm check
    shm: tuple[ShmReport, ...] = ()  # each node's /dev/shm check, when it ran
    error: str = ""  # what went wrong with the failed command(s), each node's in a group ("w2: exit status 1")


class Restarter:
    """Runs a restart plan; ``runners`` maps node name to the Runner that runs that node's commands, ``nodes`` gives
    the other nodes' pre-start hooks, ``sweepers`` (node name -> Sweeper) the /dev/shm check (none: no check)."""

    def __init__(self, section: RestartSection, runners: Mapping[str, Runner] | None = None,
                 clock: Callable[[], float] = time.monotonic, nodes: Sequence[NodeSection] = (),
                 sweepers: Mapping[str, Sweeper] | None = None, wall: Callable[[], float] = time.time) -> None:
        self.section, self.wall = section, wall
        self.runners: dict[str, Runner] = dict(runners) if runners is not None else {"local": LocalRunner()}
        self.clock = clock
        self.commands = plan(section, nodes)
        self.sweepers: dict[str, Sweeper] = dict(sweepers or {})
        self.check_at = shm_check_at(self.commands)
        for command in self.commands:
            if command.node not in self.runners:
                raise ValueError(f"no runner for node {command.node!r} ({command.description}); "
                                 f"runners: {', '.join(self.runners) or 'none'}")

    def _sweep(self, node: str, sweep: Sweeper) -> tuple[ShmReport, float]:
        started = self.clock()
        try:
            return sweep(), self.clock() - started
        except Exception as e:  # a sweeper should not raise; if it does, it is reported, not fatal
            return ShmReport(node, error=f"{type(e).__name__}: {e}"), self.clock() - started

    def _check_shm(self, records: list[dict[str, Any]]) -> tuple[ShmReport, ...]:
        """Every node's /dev/shm at once (a node out of reach costs its own call's timeout), reported in order."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.sweepers)), thread_name_prefix="restart-shm") as pool:
            done = list(pool.map(self._sweep, self.sweepers, self.sweepers.values()))
        for node, (report, seconds) in zip(self.sweepers, done, strict=True):
            records.append({"what": "shm check", "node": node, "ok": not report.error,
                            "seconds": round(seconds, 2), "error": report.error,
                            "stale": len(report.stale), "removed": len(report.removed)})
            log.log(logging.WARNING if report.stale or report.error else logging.INFO,
                    "restart: /dev/shm on node %s: %d stale segment(s), %d bytes; removed %d (%d bytes)%s",
                    node, len(report.stale), sum(b for _, b in report.stale), len(report.removed),
                    sum(b for _, b in report.removed), f"; {report.error}" if report.error else "")
        return tuple(r for r, _ in done)

    def _killed(self, command: PlannedCommand, result: RunResult, began: float) -> str:
        """A docker stop/restart that took its whole ``--time``: did docker have to SIGKILL the container? Asked of
        docker's own events on this host; on another node (its agent runs only its steps) told from the time."""
        given = docker_time_given(result.argv)
        if given is None or result.duration < given:
            return ""
        signals: str | None = None
        if command.node == "local":
            asked = self.runners["local"](kills_argv(result.argv[-1], began - 1.0, self.wall()), 10.0)
            signals = asked.output if asked.ok else None
        return killed_note(result.argv[1], given, result.duration, signals)

    def _one(self, command: PlannedCommand, time_left: float) -> tuple[RunResult, dict[str, Any], bool]:
        """Run one command with the time left in its step: its result, its record, whether it counts as done."""
        began = self.wall()
        if time_left > 0:
            result = self.runners[command.node](argv_for(command, time_left), time_left)
        else:
            result = RunResult(command.argv, None, 0.0, True,
                               error=f"not run: the step's {secs(command.timeout)}s were used up")
        # a transient unit systemd does not know: nothing runs as it, so there is nothing to stop
        not_loaded = command.not_loaded_ok and result.rc == SYSTEMCTL_NOT_LOADED and not result.timed_out
        ok = result.ok or not_loaded
        if not ok and (said := output_said(result.output)):  # the command's own reason (docker's stderr)
            result = replace(result, error=f"{result.error}: {said}")
        record = {"what": command.description, "node": command.node, "argv": shlex.join(result.argv)[:300],
                  "ok": ok, "rc": result.rc, "seconds": round(result.duration, 2),
                  "error": "" if not_loaded else result.error}
        if not_loaded:
            record["note"] = "not loaded: nothing ran as it"
        if result.ok and (killed := self._killed(command, result, began)):
            record["killed"] = killed
        log.log(logging.WARNING if record.get("killed") or not ok else logging.INFO,
                "restart: %s on node %s: %s (rc %s, %.1fs)", command.description, command.node,
                record.get("killed") or record.get("note") or record["error"] or "ok", result.rc, result.duration)
        return result, record, ok

    def run(self, cancel: threading.Event | None = None) -> RestartOutcome:
        if not self.commands:
            raise ValueError("no restart steps configured")
        started = self.clock()
        deadlines: dict[object, float] = {}  # by step (a hook: by its node)
        results: list[RunResult] = []
        records: list[dict[str, Any]] = []
        shm: tuple[ShmReport, ...] = ()

        def outcome(ok: bool, failed: str = "", cancelled: bool = False, error: str = "") -> RestartOutcome:
            return RestartOutcome(ok, tuple(results), failed, self.clock() - started, cancelled, tuple(records), shm,
                                  error)

        if self.check_at is None and self.sweepers:
            records.append({"what": "shm check", "node": "", "ok": True, "seconds": 0.0, "error": SHM_SKIPPED,
                            "stale": 0, "removed": 0})
            log.warning("restart: /dev/shm %s", SHM_SKIPPED)
        # each command once, group after group: a failed one is never retried (see the module's docstring), so no
        # tenacity here; a group of several nodes runs at once, every node's command to its end, and the restart
        # stops after the group if any failed: no node is left mid-command, none goes on to the next step
        at = 0
        for group in groups(self.commands):
            if cancel is not None and cancel.is_set():
                log.info("restart: cancelled before %s", group[0].description)
                return outcome(False, group[0].description, True)
            if self.check_at is not None and at <= self.check_at < at + len(group):
                shm = self._check_shm(records)
            at += len(group)
            now = self.clock()
            left = [deadlines.setdefault(c.step if c.step is not None else ("pre-start", c.node), now + c.timeout)
                    - now for c in group]
            if len(group) == 1:
                done = [self._one(group[0], left[0])]
            else:
                with ThreadPoolExecutor(max_workers=len(group), thread_name_prefix="restart-node") as pool:
                    done = list(pool.map(self._one, group, left))
            for result, record, _ in done:
                results.append(result)
                records.append(record)
            if failed := [(c, r) for c, (r, _, ok) in zip(group, done, strict=True) if not ok]:
                if len(group) == 1:  # a remote runner's error is the node's; the node is said here, once
                    c, r = failed[0]
                    return outcome(False, c.description, error=r.error if c.node == LOCAL else
                                   f"on node {c.node}: {r.error}")
                return outcome(False, "; ".join(f"{c.description} on node {c.node}" for c, _ in failed),
                               error="; ".join(f"{c.node}: {r.error}" for c, r in failed))
        if self.check_at == len(self.commands):
            shm = self._check_shm(records)
        return outcome(True)


# (ok, answered, detail) of one max_tokens=1 generation
Generate = Callable[[], tuple[bool, bool, str]]


@dataclass(frozen=True, slots=True)
class RecoveryDone:
    job: RecoveryJob
    ok: bool
    stage: str  # "steps" (a restart step failed) or "ready" (serving, or not by the deadline)
    detail: str
    ready_at: float | None = None  # wall time of the first successful generation
    steps_duration: float = 0.0
    outcome: RestartOutcome | None = None  # what the restart steps did (None: no restart was run)


@dataclass(frozen=True, slots=True)
class Progress:
    phase: Phase  # RESTARTING or PROVING
    since: float  # wall
    last_try: str = ""
    tries: int = 0
    outcome: RestartOutcome | None = None  # the restart steps' outcome, once they are done


class Recoverer(Protocol):
    """What the responder needs of a recovery runner (`RecoveryRunner`, or a test's fake)."""

    @property
    def busy(self) -> bool: ...
    progress: Progress | None
    def start(self, job: RecoveryJob) -> None: ...
    def poll(self) -> RecoveryDone | None: ...


class RecoveryRunner:
    """Restart (``restarter``; None: no steps configured, a job that asks for a restart fails), then prove."""

    def __init__(self, restarter: Restarter | None, generate: Generate, retry: float,
                 wall: Callable[[], float] = time.time, log_every: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.restarter, self._generate, self._retry = restarter, generate, retry
        self._wall, self._log_every, self._clock = wall, log_every, clock
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._done: RecoveryDone | None = None
        self._thread: threading.Thread | None = None
        self.progress: Progress | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: RecoveryJob) -> None:
        if self.busy:
            raise RuntimeError("a recovery is already running")
        self._done = None
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"recovery-{job.incident}", daemon=True)
        self._thread.start()

    def poll(self) -> RecoveryDone | None:
        with self._lock:
            done, self._done = self._done, None
            return done

    def stop(self, timeout: float = 10.0) -> None:
        """Stop waiting (a running restart command is ended by its own timeout or the cancel between steps)."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _finish(self, done: RecoveryDone) -> None:
        self.progress = None
        with self._lock:
            self._done = done

    def _run(self, job: RecoveryJob) -> None:
        try:
            self._finish(self._recover(job))
        except Exception as e:  # the recovery must never take the watcher down
            log.exception("recovery of incident %s failed", job.incident)
            self._finish(RecoveryDone(job, False, "steps", f"{type(e).__name__}: {e}"))

    def _recover(self, job: RecoveryJob) -> RecoveryDone:
        steps_took, outcome = 0.0, None
        ends = self._clock() + job.timeout  # on the monotonic clock: a step of the wall clock is no boot timeout
        if job.restart:
            self.progress = Progress(Phase.RESTARTING, self._wall())
            if self.restarter is None:
                raise RuntimeError("no restart steps configured")
            outcome = self.restarter.run(self._cancel)
            steps_took = outcome.duration
            if not outcome.ok:
                why = f"{outcome.failed}: {outcome.error}" if outcome.error else outcome.failed
                return RecoveryDone(job, False, "steps", why, steps_duration=steps_took, outcome=outcome)
        started, began = self._wall(), self._clock()
        self.progress = Progress(Phase.PROVING, started, outcome=outcome)
        next_log, tries = began + self._log_every, 0
        # not tenacity, though it retries one call: each try also updates `progress` and the periodic log, and a cancel
        # must end the wait with no further try, which a Retrying says only through three callbacks
        while not self._cancel.is_set():
            ok, _answered, detail = self._generate()
            tries += 1
            now = self._clock()
            self.progress = Progress(Phase.PROVING, started, detail, tries, outcome)
            if ok:
                log.info("incident %s: the engine serves again (%s) after %.0fs", job.incident, detail, now - began)
                return RecoveryDone(job, True, "ready", detail, self._wall(), steps_took, outcome)
            if now >= ends:
                return RecoveryDone(job, False, "ready", f"not serving by the boot timeout; last try: {detail}",
                                    steps_duration=steps_took, outcome=outcome)
            if now >= next_log:
                log.info("incident %s: waiting for the engine to serve: %.0fs so far, %.0fs left; last try: %s",
                         job.incident, now - began, ends - now, detail)
                next_log = now + self._log_every
            self._cancel.wait(min(self._retry, max(0.0, ends - now)))
        return RecoveryDone(job, False, "ready", "stopped while waiting for the engine", steps_duration=steps_took,
                            outcome=outcome)
