"""Act: run the configured restart steps in order, each command with what is left of its step's timeout.

``plan`` turns ``[[restart.steps]]`` into single commands, never shell strings:

* systemd: ``systemctl --no-ask-password <verb> -- <unit>``, one unit at a time in the order written
  (systemctl given several units acts on them in parallel);
* docker: ``docker <verb> [--time N] <container>``, one at a time; stop and restart get ``--time`` a margin
  below the time left in the step, so docker escalates to SIGKILL before our own timeout fires;
* command: its argv as written.

Pre-start hooks, one per node, each with its own timeout: ``restart.pre_start`` is the head's ("local") hook and
each ``[[nodes]]`` entry's ``pre_start`` is that node's, run ON that node (through its agent's ``run`` verb: the
agent's own config must list the same argv as its ``pre_start``). A node's hook runs right before the first
starting step that runs on that node: its first step whose action is start or restart (a command step may say
``action = "start"``, ``"stop"`` or ``"restart"``); when it has none, its first command step that does not say
(``action = "run"``, the default: what it does cannot be known). A node with no such step of its own gets its hook
right before the first starting step overall (same rule over every step). With no starting step at all (stop
steps only) no hook runs. Hooks that fall before the same step run local first, then the nodes in config order.
With no ``[[nodes]]`` this is the single-host rule as it always was.

The /dev/shm check (`Restarter` with ``sweepers``, one per node, local too): after the last stop step, before the
first starting command (a hook, a start/restart, a command that does not say), or after the last step when nothing
starts, every node reports the stale shared-memory segments a dead engine left in /dev/shm (``psm_*``,
``sem.mp-*`` no process has open or mapped) and removes them where configured (``restart.remove_shm`` for the
head, the node's ``remove_shm`` there, which its agent's own ``remove_shm`` must allow). What was found and
removed (names and bytes) is in ``RestartOutcome.shm`` and the step records; a check that fails is reported there
and never fails the restart.

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

from watchdog.childenv import child_env
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.nodes import LOCAL, NodeSection

log = logging.getLogger(__name__)

OUTPUT_TAIL_BYTES = 2048
KILL_GRACE = 2.0  # seconds from SIGTERM to SIGKILL for a timed-out command's process group
STARTING_VERBS = ("start", "restart")


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
            return RunResult(args, None, duration, True, output, f"timed out after {_secs(timeout)}s")
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
            log.warning("restart: pid %d survived SIGKILL for %ss", child.pid, _secs(self.kill_grace))


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


def _secs(seconds: float) -> str:
    return f"{seconds:.1f}".removesuffix(".0")


@dataclass(frozen=True, slots=True)
class PlannedCommand:
    step: int | None  # index into restart.steps; None for the pre-start hook
    kind: str  # systemd | docker | command | pre-start
    description: str  # "systemd stop vllm-head.service", "pre-start hook", "command /opt/restart.sh"
    node: str
    argv: tuple[str, ...]
    timeout: float  # the most it can get: its step's whole timeout (at run time, what is left of it)
    starts: bool = False  # a starting command (start/restart, a command step, a hook): the /dev/shm check is before


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


def docker_stop_time(timeout: float) -> int:
    """``docker stop/restart --time``: a margin below ``timeout``, at least 1 s."""
    margin = min(15.0, max(2.0, timeout / 10))
    return max(1, int(timeout - margin))


def plan(section: RestartSection, nodes: Sequence[NodeSection] = ()) -> list[PlannedCommand]:
    """The commands a restart runs, in order (see the module docstring for the rules)."""
    hooks: dict[int, list[PlannedCommand]] = {}
    overall = _first_start(section.steps)
    for name, argv, timeout in ((LOCAL, section.pre_start, section.pre_start_timeout),
                                *((n.name, n.pre_start, n.pre_start_timeout) for n in nodes)):
        own = _first_start(section.steps, name)
        at = own if own is not None else overall
        if argv and at is not None:
            what = "pre-start hook" if name == LOCAL else f"pre-start hook on node {name}"
            hooks.setdefault(at, []).append(PlannedCommand(None, "pre-start", what, name, tuple(argv), timeout, True))
    commands: list[PlannedCommand] = []
    for index, step in enumerate(section.steps):
        commands.extend(hooks.get(index, ()))
        commands.extend(_step_commands(index, step))
    return commands


def _first_start(steps: Sequence[StepSection], node: str | None = None) -> int | None:
    """The first starting step (of ``node``'s steps, or of all): start/restart, else the first command step that
    does not say what it does (``action = "run"``, the default)."""
    mine = [(i, s) for i, s in enumerate(steps) if node is None or s.node == node]
    starting = [i for i, s in mine if s.verb in STARTING_VERBS]
    unsaid = [i for i, s in mine if s.kind == "command" and s.verb == "run"]
    return next(iter(starting or unsaid), None)


SHM_SKIPPED = ("not done: nothing is stopped before the first start (a restart step stops and starts in one, so the "
               "dead engine's segments are in use before it and the new engine's are being made after it); add a "
               "stop step first to check /dev/shm")


def shm_check_at(commands: Sequence[PlannedCommand]) -> int | None:
    """Where the /dev/shm check goes: before the first starting command, or after the last when none starts; None
    when nothing is stopped before the first starting command (`SHM_SKIPPED` says why)."""
    first = next((i for i, c in enumerate(commands) if c.starts), len(commands))
    if first < len(commands) and first == 0:
        return None
    return first


def _step_commands(index: int, step: StepSection) -> list[PlannedCommand]:
    verb, node, timeout = step.verb, step.node, step.timeout
    starts = verb in (*STARTING_VERBS, "run")
    if step.kind == "systemd":
        return [PlannedCommand(index, "systemd", f"systemd {verb} {unit}", node,
                               ("systemctl", "--no-ask-password", verb, "--", unit), timeout, starts)
                for unit in step.units]
    if step.kind == "docker":
        stop_time = ("--time", str(docker_stop_time(timeout))) if verb in ("stop", "restart") else ()
        return [PlannedCommand(index, "docker", f"docker {verb} {name}", node, ("docker", verb, *stop_time, name),
                               timeout, starts) for name in step.containers]
    if step.kind == "command":
        return [PlannedCommand(index, "command", f"command {step.argv[0]}", node, step.argv, timeout, starts)] \
            if step.argv else []
    raise ValueError(f"restart.steps[{index}]: unknown kind {step.kind!r}")


def _argv_for(command: PlannedCommand, time_left: float) -> tuple[str, ...]:
    """The argv with docker's ``--time`` lowered to fit the time left in the step."""
    argv = command.argv
    if command.kind != "docker" or "--time" not in argv:
        return argv
    at = argv.index("--time") + 1
    return (*argv[:at], str(min(int(argv[at]), docker_stop_time(time_left))), *argv[at + 1:])


def describe(section: RestartSection, nodes: Sequence[NodeSection] = ()) -> list[str]:
    """The plan for people (``--dry-run``, ``watchdog status``): one line per command."""
    return [f"{c.description} (node {c.node}, up to {_secs(c.timeout)}s): {shlex.join(c.argv)}"
            for c in plan(section, nodes)]


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
                result = self.runners[command.node](_argv_for(command, time_left), time_left)
            else:
                result = RunResult(command.argv, None, 0.0, True,
                                   error=f"not run: the step's {_secs(command.timeout)}s were used up")
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
