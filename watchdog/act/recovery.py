"""Recovery in the background: run the restart steps, then prove the engine is back with a real generation.

The engine counts as back only when a ``max_tokens=1`` completion succeeds, tried every ``retry`` seconds until a
deadline (the boot timeout: large checkpoints take tens of minutes). Progress is logged every half minute and kept
in ``progress`` for the status file and metrics. The watcher goes on scraping meanwhile; the daemon pauses the
restart policy for the stack while a recovery runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from watchdog.act.incident_types import RecoveryJob
from watchdog.act.restart import RestartOutcome

log = logging.getLogger(__name__)

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
    phase: str  # restarting | proving
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
    def __init__(self, restart: Callable[[threading.Event], RestartOutcome], generate: Generate, retry: float,
                 wall: Callable[[], float] = time.time, log_every: float = 30.0) -> None:
        self._restart, self._generate, self._retry = restart, generate, retry
        self._wall, self._log_every = wall, log_every
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
        if job.restart:
            self.progress = Progress("restarting", self._wall())
            outcome = self._restart(self._cancel)
            steps_took = outcome.duration
            if not outcome.ok:
                last = outcome.results[-1] if outcome.results else None
                why = f"{outcome.failed}: {last.error}" if last is not None else outcome.failed
                return RecoveryDone(job, False, "steps", why, steps_duration=steps_took, outcome=outcome)
        started = self._wall()
        self.progress = Progress("proving", started, outcome=outcome)
        next_log, tries = started + self._log_every, 0
        # not tenacity, though it retries one call: each try also updates `progress` and the periodic log, and a cancel
        # must end the wait with no further try, which a Retrying says only through three callbacks
        while not self._cancel.is_set():
            ok, _answered, detail = self._generate()
            tries += 1
            now = self._wall()
            self.progress = Progress("proving", started, detail, tries, outcome)
            if ok:
                log.info("incident %s: the engine serves again (%s) after %.0fs", job.incident, detail, now - started)
                return RecoveryDone(job, True, "ready", detail, now, steps_took, outcome)
            if now >= job.deadline:
                return RecoveryDone(job, False, "ready", f"not serving by the boot timeout; last try: {detail}",
                                    steps_duration=steps_took, outcome=outcome)
            if now >= next_log:
                log.info("incident %s: waiting for the engine to serve: %.0fs so far, %.0fs left; last try: %s",
                         job.incident, now - started, job.deadline - now, detail)
                next_log = now + self._log_every
            self._cancel.wait(min(self._retry, max(0.0, job.deadline - now)))
        return RecoveryDone(job, False, "ready", "stopped while waiting for the engine", steps_duration=steps_took,
                            outcome=outcome)
