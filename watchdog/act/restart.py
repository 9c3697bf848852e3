"""Act: run the configured restart steps in order, each command with what is left of its step's timeout.

The commands and their order come from `watchdog.config.restart_plan` (pure; its docstring has the rules).

The /dev/shm check (`Restarter` with ``sweepers``, one per node, local too), where `restart_plan.shm_check_at`
puts it: after the last stop step and before the first starting command, or after the last step when nothing
starts; not at all when the first command already starts (it says so). Every node reports the stale shared-memory
segments a dead engine left in /dev/shm (``psm_*``, ``sem.mp-*`` no process has open or mapped) and removes them
where configured (``restart.remove_shm`` for the head, the node's ``remove_shm`` there, which its agent's own
``remove_shm`` must allow). What was found and removed (names and bytes) is in ``RestartOutcome.shm`` and the step
records; a check that fails is reported there and never fails the restart.

A step's timeout covers all its commands: each gets the time left in the step when it starts. ``Restarter.run``
stops at the first failed command, a failed stop included: starting over a half-stopped stack is worse than
leaving it to a human. The cancel event is checked between commands, never mid-command.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol

from watchdog.config.act import RestartSection
from watchdog.config.nodes import NodeSection
from watchdog.config.restart_plan import SHM_SKIPPED, argv_for, plan, secs, shm_check_at
from watchdog.host.childenv import child_env

log = logging.getLogger(__name__)

OUTPUT_TAIL_BYTES = 2048
KILL_GRACE = 2.0  # seconds from SIGTERM to SIGKILL for a timed-out command's process group


@dataclass(frozen=True, slots=True)
class RunResult:
    argv: tuple[str, ...]
    rc: int | None  # None: it could not start, or it timed out
    duration: float
    timed_out: bool = False
    output: str = ""  # the last ~2 KB of stdout and stderr, merged
    error: str = ""  # "" when rc == 0, else what went wrong in a few words

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out


class Runner(Protocol):
    """Runs one argv with a timeout; never raises for a command that fails or cannot start."""

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult: ...


class LocalRunner:
    """Runs a command on this host in a session of its own; on timeout, ends its whole process group."""

    def __init__(self, kill_grace: float = KILL_GRACE) -> None:
        self.kill_grace = kill_grace

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        args = tuple(argv)
        started = time.monotonic()
        if not args:
            return RunResult(args, None, 0.0, error="empty command")
        # Output goes to a file, not a pipe: a grandchild holding it open cannot keep us waiting.
        with tempfile.TemporaryFile() as out:
            try:
                child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=child_env())
            except OSError as e:
                reason = ("program not found" if isinstance(e, FileNotFoundError) else "permission denied"
                          if isinstance(e, PermissionError) else f"cannot run ({e.strerror or e})")
                return RunResult(args, None, time.monotonic() - started, error=f"{reason}: {args[0]}")
            try:
                rc: int | None = child.wait(timeout=max(timeout, 0.0))
            except subprocess.TimeoutExpired:
                rc = None
                self._end_group(child)
            duration = time.monotonic() - started
            output = _tail(out)
        if rc is None:
            return RunResult(args, None, duration, True, output, f"timed out after {secs(timeout)}s")
        return RunResult(args, rc, duration, False, output, _exit_error(rc))

    def _end_group(self, child: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the group (pgid = the child's pid), a short grace, then SIGKILL to whatever is left."""
        _signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace
        while time.monotonic() < deadline:
            child.poll()  # reap the child, so an empty group reads as gone
            if not _signal_group(child.pid, 0):
                break
            time.sleep(0.05)
        _signal_group(child.pid, signal.SIGKILL)
        try:
            child.wait(timeout=self.kill_grace)
        except subprocess.TimeoutExpired:  # stuck in the kernel (D state): give up, do not hang the restart
            log.warning("restart: pid %d survived SIGKILL for %ss", child.pid, secs(self.kill_grace))


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal (it changed its uid): it still exists
        pass
    return True


def _tail(out: IO[bytes]) -> str:
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - OUTPUT_TAIL_BYTES))
    return out.read().decode("utf-8", errors="replace")


def _exit_error(rc: int) -> str:
    if rc >= 0:
        return f"exit status {rc}" if rc else ""
    try:
        return f"killed by {signal.Signals(-rc).name}"
    except ValueError:
        return f"killed by signal {-rc}"


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


class Restarter:
    """Runs a restart plan; ``runners`` maps node name to the Runner that runs that node's commands, ``nodes`` gives
    the other nodes' pre-start hooks, ``sweepers`` (node name -> Sweeper) the /dev/shm check (none: no check)."""

    def __init__(self, section: RestartSection, runners: Mapping[str, Runner] | None = None,
                 clock: Callable[[], float] = time.monotonic, nodes: Sequence[NodeSection] = (),
                 sweepers: Mapping[str, Sweeper] | None = None) -> None:
        self.section = section
        self.runners: dict[str, Runner] = dict(runners) if runners is not None else {"local": LocalRunner()}
        self.clock = clock
        self.commands = plan(section, nodes)
        self.sweepers: dict[str, Sweeper] = dict(sweepers or {})
        self.check_at = shm_check_at(self.commands)
        for command in self.commands:
            if command.node not in self.runners:
                raise ValueError(f"no runner for node {command.node!r} ({command.description}); "
                                 f"runners: {', '.join(self.runners) or 'none'}")

    def _check_shm(self, records: list[dict[str, Any]]) -> tuple[ShmReport, ...]:
        reports = []
        for node, sweep in self.sweepers.items():
            started = self.clock()
            try:
                report = sweep()
            except Exception as e:  # a sweeper should not raise; if it does, it is reported, not fatal
                report = ShmReport(node, error=f"{type(e).__name__}: {e}")
            reports.append(report)
            records.append({"what": "shm check", "node": node, "ok": not report.error,
                            "seconds": round(self.clock() - started, 2), "error": report.error,
                            "stale": len(report.stale), "removed": len(report.removed)})
            log.log(logging.WARNING if report.stale or report.error else logging.INFO,
                    "restart: /dev/shm on node %s: %d stale segment(s), %d bytes; removed %d (%d bytes)%s", node,
                    len(report.stale), sum(b for _, b in report.stale), len(report.removed),
                    sum(b for _, b in report.removed), f"; {report.error}" if report.error else "")
        return tuple(reports)

    def run(self, cancel: threading.Event | None = None) -> RestartOutcome:
        if not self.commands:
            raise ValueError("no restart steps configured")
        started = self.clock()
        deadlines: dict[object, float] = {}  # by step (a hook: by its node)
        results: list[RunResult] = []
        records: list[dict[str, Any]] = []
        shm: tuple[ShmReport, ...] = ()

        def outcome(ok: bool, failed: str = "", cancelled: bool = False) -> RestartOutcome:
            return RestartOutcome(ok, tuple(results), failed, self.clock() - started, cancelled, tuple(records), shm)

        if self.check_at is None and self.sweepers:
            records.append({"what": "shm check", "node": "", "ok": True, "seconds": 0.0, "error": SHM_SKIPPED,
                            "stale": 0, "removed": 0})
            log.warning("restart: /dev/shm %s", SHM_SKIPPED)
        for i, command in enumerate(self.commands):
            if cancel is not None and cancel.is_set():
                log.info("restart: cancelled before %s", command.description)
                return outcome(False, command.description, True)
            if i == self.check_at:
                shm = self._check_shm(records)
            now = self.clock()
            key = command.step if command.step is not None else ("pre-start", command.node)
            time_left = deadlines.setdefault(key, now + command.timeout) - now
            if time_left > 0:
                result = self.runners[command.node](argv_for(command, time_left), time_left)
            else:
                result = RunResult(command.argv, None, 0.0, True,
                                   error=f"not run: the step's {secs(command.timeout)}s were used up")
            results.append(result)
            records.append({"what": command.description, "node": command.node, "argv": shlex.join(result.argv)[:300],
                            "ok": result.ok, "rc": result.rc, "seconds": round(result.duration, 2),
                            "error": result.error})
            log.info("restart: %s: %s (rc %s, %.1fs)", command.description, result.error or "ok", result.rc,
                     result.duration)
            if not result.ok:
                return outcome(False, command.description)
        if self.check_at == len(self.commands):
            shm = self._check_shm(records)
        return outcome(True)
