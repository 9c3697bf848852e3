"""Act, pure: the commands a restart runs, in order, from ``[[restart.steps]]``; nothing here runs them
(`watchdog.act.restart` does).

`plan` turns ``[[restart.steps]]`` into single commands, never shell strings:

* systemd: ``systemctl --no-ask-password <verb> -- <unit>``, one unit at a time in the order written
  (systemctl given several units acts on them in parallel);
* docker: ``docker <verb> [--time N] <container>``, one at a time; stop and restart get ``--time`` a margin
  below the time left in the step, so docker escalates to SIGKILL before our own timeout fires;
* command: its argv as written; with ``transient_unit`` (an engine it starts outlives the watchdog), first
  ``systemctl --no-ask-password stop -- <unit>`` unless ``action = "start"`` (a unit not loaded: nothing runs as
  it, done), then ``systemd-run --no-ask-password --unit=<unit> --collect --service-type=exec
  --property=TimeoutStopSec=N [--property=...] -- <argv>``: systemd itself starts argv as that service, in its
  own cgroup and without the watchdog's sandbox. It returns once argv is executed (``exec``: a missing program
  fails the step), not when it ends: an engine runs until stopped, and the watchdog proves it serves as after any
  start. ``TimeoutStopSec`` is `docker_stop_time` of the step's timeout, so the next restart's stop escalates to
  SIGKILL inside its step. ``--collect``: a unit that failed is forgotten, so its name can be started again.

Pre-start hooks, one per node, each with its own timeout: ``restart.pre_start`` is the head's ("local") hook and
each ``[[nodes]]`` entry's ``pre_start`` is that node's, run ON that node (through its agent's ``run`` verb: the
agent's own config must list the same argv as its ``pre_start``). A node's hook runs right before the first
starting step that runs on that node: its first step whose action is start or restart (a command step may say
``action = "start"``, ``"stop"`` or ``"restart"``); when it has none, its first command step that does not say
(``action = "run"``, the default: what it does cannot be known). A node with no such step of its own gets its hook
right before the first starting step overall (same rule over every step). With no starting step at all (stop
steps only) no hook runs. Hooks that fall before the same step run local first, then the nodes in config order.
With no ``[[nodes]]`` only this host's hooks run, by the same rule. A transient unit's restart step stops before
it starts: its hooks run between the two.

A step with ``nodes = [...]`` runs on each of them at once: its commands become groups (`PlannedCommand.group`),
command k of every node together, then command k+1 (a transient unit's stop on every node, then its start on every
node); the hooks due before it run together too, right before its first starting group. Every other command is a
group of its own: the plan runs group after group, in order.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace

from watchdog.config.act import RestartSection, StepSection
from watchdog.config.nodes import NodeSection
from watchdog.core.processes import LOCAL

STARTING_VERBS = ("start", "restart")


def secs(seconds: float) -> str:
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
    not_loaded_ok: bool = False  # systemctl stop of a transient unit: "not loaded" (exit 5) means nothing to stop
    group: int = 0  # commands of one group run at once, one per node (a step with ``nodes``); groups in order


SYSTEMCTL_NOT_LOADED = 5  # systemctl's exit status for a unit systemd does not know (LSB: not installed)


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
    phases: list[list[PlannedCommand]] = []  # each phase one group
    for index, step in enumerate(section.steps):
        lanes = [_step_commands(index, replace(step, node=node, nodes=())) for node in step.on]
        at = next((i for i, c in enumerate(lanes[0]) if c.starts), 0)  # a transient restart's hook: after its stop
        if not step.nodes:  # one node: one command at a time, its hooks one at a time
            phases += [[c] for c in (*lanes[0][:at], *hooks.get(index, ()), *lanes[0][at:])]
            continue
        # several nodes: command k of every node together; the hooks due here together, before the first start
        spread = [list(k) for k in zip(*lanes, strict=True)]
        phases += [*spread[:at], *([hooks[index]] if index in hooks else []), *spread[at:]]
    return [replace(c, group=g) for g, phase in enumerate(phases) for c in phase]


def groups(commands: Sequence[PlannedCommand]) -> list[list[PlannedCommand]]:
    """The plan's commands by group, in order (`PlannedCommand.group`): each group runs at once, one after another."""
    out: list[list[PlannedCommand]] = []
    for c in commands:
        if out and out[-1][0].group == c.group:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _first_start(steps: Sequence[StepSection], node: str | None = None) -> int | None:
    """The first starting step (of ``node``'s steps, or of all): start/restart, else the first command step that
    does not say what it does (``action = "run"``, the default)."""
    mine = [(i, s) for i, s in enumerate(steps) if node is None or node in s.on]
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
    return None if first == 0 and commands else first


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
    if step.kind == "command" and step.transient_unit:
        return _transient_commands(index, step)
    if step.kind == "command":
        return [PlannedCommand(index, "command", f"command {step.argv[0]}", node, step.argv, timeout, starts)] \
            if step.argv else []
    raise ValueError(f"restart.steps[{index}]: unknown kind {step.kind!r}")


def _transient_commands(index: int, step: StepSection) -> list[PlannedCommand]:
    """A command step run as its own transient service (see the module docstring)."""
    unit, node, timeout = step.transient_unit, step.node, step.timeout
    if not step.argv:
        return []
    stop = PlannedCommand(index, "command", f"command stop {unit} (its transient unit)", node,
                          ("systemctl", "--no-ask-password", "stop", "--", unit), timeout, False, True)
    start = PlannedCommand(index, "command", f"command {step.argv[0]} as {unit}", node,
                           ("systemd-run", "--no-ask-password", f"--unit={unit}", "--collect", "--service-type=exec",
                            f"--property=TimeoutStopSec={docker_stop_time(timeout)}",
                            *(f"--property={p}" for p in step.unit_properties), "--", *step.argv), timeout, True)
    return [start] if step.verb == "start" else [stop, start]


def argv_for(command: PlannedCommand, time_left: float) -> tuple[str, ...]:
    """The argv with docker's ``--time`` lowered to fit the time left in the step."""
    argv = command.argv
    if command.kind != "docker" or "--time" not in argv:
        return argv
    at = argv.index("--time") + 1
    return (*argv[:at], str(min(int(argv[at]), docker_stop_time(time_left))), *argv[at + 1:])


def docker_time_given(argv: Sequence[str]) -> int | None:
    """The ``--time`` a ``docker stop/restart`` argv gives docker (None: not such a command)."""
    if len(argv) < 4 or argv[0] != "docker" or argv[1] not in ("stop", "restart") or "--time" not in argv:
        return None
    try:
        return int(argv[argv.index("--time") + 1])
    except (IndexError, ValueError):
        return None


def killed_note(verb: str, given: int, took: float, signals: str | None) -> str:
    """What to say of a docker stop/restart that took ``took`` s with ``--time given``: "" when it stopped within
    that time. ``signals``: what `watchdog.host.docker_cli.kills_argv` printed (None: could not be asked; then a
    stop that took the whole time was killed, a restart (stop, then start) cannot be told)."""
    if took < given:
        return ""
    if signals is None:
        return (f"not stopped within {given}s of SIGTERM: docker killed it (SIGKILL)" if verb == "stop" else
                f"took {took:.1f}s, --time {given}s: docker may have killed it (SIGKILL); its events could not be read")
    if {"9", "KILL", "SIGKILL"} & set(signals.split()):
        return f"not stopped within {given}s of SIGTERM: docker killed it (SIGKILL)"
    return ""


def output_said(output: str, limit: int = 300) -> str:
    """The last lines a failed command printed (docker's and systemctl's own reason), one line, at most ``limit``.
    A CLI's deprecation notice is left out (docker 23+ says "Flag --time has been deprecated" before its reason)."""
    lines = [line.strip() for line in output.strip().splitlines()
             if line.strip() and "has been deprecated" not in line]
    said = " | ".join(lines[-3:])
    return said if len(said) <= limit else "..." + said[-(limit - 3):]


def describe(section: RestartSection, nodes: Sequence[NodeSection] = ()) -> list[str]:
    """The plan for people (``--dry-run``, ``watchdog status``): one line per command."""
    commands = plan(section, nodes)
    together = {g: sum(c.group == g for c in commands) for g in {c.group for c in commands}}
    return [f"{c.description} (node {c.node}, up to {secs(c.timeout)}s"
            + (f", at once with {together[c.group] - 1} other node(s)" if together[c.group] > 1 else "")
            + f"): {shlex.join(c.argv)}" for c in commands]
