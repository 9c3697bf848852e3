"""Act: run the configured restart steps in order, each command with what is left of its step's timeout.

``plan`` turns ``[[restart.steps]]`` into single commands, never shell strings:

* systemd: ``systemctl --no-ask-password <verb> -- <unit>``, one unit at a time in the order written
  (systemctl given several units acts on them in parallel);
* docker: ``docker <verb> [--time N] <container>``, one at a time; stop and restart get ``--time`` a margin
  below the time left in the step, so docker escalates to SIGKILL before our own timeout fires;
* command: its argv as written.

The pre-start hook (``restart.pre_start``, own timeout ``pre_start_timeout``) runs once, right before the first
systemd/docker step whose verb is start or restart; when there is none, before the first command step (what a
command does cannot be known); with neither (stop steps only) it does not run.

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
from typing import IO, Protocol

from watchdog.childenv import child_env
from watchdog.config.act import RestartSection, StepSection

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


def docker_stop_time(timeout: float) -> int:
    """``docker stop/restart --time``: a margin below ``timeout``, at least 1 s."""
    margin = min(15.0, max(2.0, timeout / 10))
    return max(1, int(timeout - margin))


def plan(section: RestartSection) -> list[PlannedCommand]:
    """The commands a restart runs, in order (see the module docstring for the rules)."""
    hook_before = _pre_start_step(section) if section.pre_start else None
    commands: list[PlannedCommand] = []
    for index, step in enumerate(section.steps):
        if index == hook_before:
            commands.append(PlannedCommand(None, "pre-start", "pre-start hook", "local", section.pre_start,
                                           section.pre_start_timeout))
        commands.extend(_step_commands(index, step))
    return commands


def _pre_start_step(section: RestartSection) -> int | None:
    starting = [i for i, s in enumerate(section.steps) if s.kind != "command" and s.verb in STARTING_VERBS]
    commands = [i for i, s in enumerate(section.steps) if s.kind == "command"]
    return next(iter(starting or commands), None)


def _step_commands(index: int, step: StepSection) -> list[PlannedCommand]:
    verb, node, timeout = step.verb, step.node, step.timeout
    if step.kind == "systemd":
        return [PlannedCommand(index, "systemd", f"systemd {verb} {unit}", node,
                               ("systemctl", "--no-ask-password", verb, "--", unit), timeout) for unit in step.units]
    if step.kind == "docker":
        stop_time = ("--time", str(docker_stop_time(timeout))) if verb in ("stop", "restart") else ()
        return [PlannedCommand(index, "docker", f"docker {verb} {name}", node, ("docker", verb, *stop_time, name),
                               timeout) for name in step.containers]
    if step.kind == "command":
        return [PlannedCommand(index, "command", f"command {step.argv[0]}", node, step.argv, timeout)] \
            if step.argv else []
    raise ValueError(f"restart.steps[{index}]: unknown kind {step.kind!r}")


def _argv_for(command: PlannedCommand, time_left: float) -> tuple[str, ...]:
    """The argv with docker's ``--time`` lowered to fit the time left in the step."""
    argv = command.argv
    if command.kind != "docker" or "--time" not in argv:
        return argv
    at = argv.index("--time") + 1
    return (*argv[:at], str(min(int(argv[at]), docker_stop_time(time_left))), *argv[at + 1:])


def describe(section: RestartSection) -> list[str]:
    """The plan for people (``--dry-run``, ``watchdog status``): one line per command."""
    return [f"{c.description} (node {c.node}, up to {_secs(c.timeout)}s): {shlex.join(c.argv)}"
            for c in plan(section)]


@dataclass(frozen=True, slots=True)
class RestartOutcome:
    ok: bool
    results: tuple[RunResult, ...]  # one per command run, in order
    failed: str = ""  # the description of the command that failed (cancelled: of the one not run)
    duration: float = 0.0
    cancelled: bool = False


class Restarter:
    """Runs a restart plan; ``runners`` maps node name to the Runner that runs that node's commands."""

    def __init__(self, section: RestartSection, runners: Mapping[str, Runner] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.section = section
        self.runners: dict[str, Runner] = dict(runners) if runners is not None else {"local": LocalRunner()}
        self.clock = clock
        self.commands = plan(section)
        for command in self.commands:
            if command.node not in self.runners:
                raise ValueError(f"no runner for node {command.node!r} ({command.description}); "
                                 f"runners: {', '.join(self.runners) or 'none'}")

    def run(self, cancel: threading.Event | None = None) -> RestartOutcome:
        if not self.commands:
            raise ValueError("no restart steps configured")
        started = self.clock()
        deadlines: dict[int | None, float] = {}  # by step (None: the pre-start hook)
        results: list[RunResult] = []
        for command in self.commands:
            if cancel is not None and cancel.is_set():
                log.info("restart: cancelled before %s", command.description)
                return RestartOutcome(False, tuple(results), command.description, self.clock() - started, True)
            now = self.clock()
            time_left = deadlines.setdefault(command.step, now + command.timeout) - now
            if time_left > 0:
                result = self.runners[command.node](_argv_for(command, time_left), time_left)
            else:
                result = RunResult(command.argv, None, 0.0, True,
                                   error=f"not run: the step's {_secs(command.timeout)}s were used up")
            results.append(result)
            log.info("restart: %s: %s (rc %s, %.1fs)", command.description, result.error or "ok", result.rc,
                     result.duration)
            if not result.ok:
                return RestartOutcome(False, tuple(results), command.description, self.clock() - started)
        return RestartOutcome(True, tuple(results), "", self.clock() - started)
