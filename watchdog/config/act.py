"""The act stage's settings: ``[restart]`` with its ordered ``[[restart.steps]]``, ``[alerts]`` with its
``[[alerts.sinks]]``, and their checks (`watchdog.config.load` loads them like every other section). Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

# a command step's action says what it does (for the pre-start hooks and the /dev/shm check); "run": not said
STEP_KINDS = {"systemd": ("restart", "stop", "start"), "docker": ("restart", "stop", "start"),
              "command": ("run", "stop", "start", "restart")}
NODES = ("local",)  # where a step runs: "local", or a node named in [[nodes]] (check_restart is given the names)
WATCHDOG_UNIT = "engine-watchdog.service"
# a transient service's name as systemd-run takes it (no template instances), and one --property= setting
TRANSIENT_UNIT = re.compile(r"[A-Za-z0-9:_.\\-]{1,248}\.service")
UNIT_PROPERTY = re.compile(r"[A-Z][A-Za-z0-9]*=[^\n\x00]*")


@dataclass(frozen=True, slots=True)
class StepSection:
    """One restart step: ``[[restart.steps]]``, run in the order written."""

    kind: str = "command"  # systemd | docker | command
    action: str = ""  # restart | stop | start; command also run (what it does unsaid); default: restart, run
    units: tuple[str, ...] = ()  # systemd: acted on one at a time, in this order
    containers: tuple[str, ...] = ()  # docker: likewise
    argv: tuple[str, ...] = ()  # command: the program and its arguments, never a shell string
    timeout: float = 300.0  # for the whole step
    node: str = "local"
    # the same step on each of these nodes at once ("local" may be one): command k of every node together, then
    # command k+1; the step ends when every node's are done (each bounded by the step's timeout); instead of node
    nodes: tuple[str, ...] = ()
    # command: run argv as this transient service (systemd-run), outside the watchdog's unit, cgroup and sandbox
    transient_unit: str = ""
    unit_properties: tuple[str, ...] = ()  # with transient_unit: systemd-run --property= settings (User=vllm, ...)

    @property
    def on(self) -> tuple[str, ...]:
        """The nodes it runs on: ``nodes``, else ``node``."""
        return self.nodes or (self.node,)

    @property
    def verb(self) -> str:
        if not self.action and self.transient_unit:
            return "restart"  # stop what still runs as that unit, then start argv as it
        return self.action or STEP_KINDS.get(self.kind, ("run",))[0]


@dataclass(frozen=True, slots=True)
class RestartSection:
    steps: tuple[StepSection, ...] = ()  # none: observe and alert only
    pre_start: tuple[str, ...] = ()  # argv run before the first start/restart step (e.g. drop page caches)
    pre_start_timeout: float = 120.0
    remove_shm: bool = False  # before the first start, remove the segments a dead engine left in this host's /dev/shm
    dry_run: bool = False  # do everything except act
    supervised: bool = False  # the stack's own supervisor restarts an engine that exited: on down, only wait
    down_after: float = 10.0  # down this long (not a blip) before it counts as an incident
    on_boot_timeout: bool = True  # restart when a start takes longer than boot_timeout
    boot_timeout: float = 2700.0  # from the restart to the first successful generation (large checkpoints)
    evidence_timeout: float = 90.0  # wait this long for a freeze's stacks before restarting without them
    hold_max: float = 900.0  # stacks showed work but no progress since: restart after holding this long
    budget: int = 3  # restarts at most per budget_window
    budget_window: float = 3600.0
    backoff_initial: float = 60.0  # wait before the 2nd restart in the window, doubling after
    backoff_max: float = 900.0


@dataclass(frozen=True, slots=True)
class SinkSection:
    """One alert receiver: ``[[alerts.sinks]]``."""

    kind: str = "webhook"  # webhook | slack | alertmanager
    name: str = ""  # how logs name it; default: the kind
    url: str = ""  # or, when the URL holds a token, url_env / url_file
    url_env: str = ""
    url_file: str = ""
    secret_env: str = ""  # webhook: HMAC-SHA256 secret, from the environment or a file
    secret_file: str = ""
    severity: str = "critical"  # alertmanager label
    firing_ttl: float = 0.0  # alertmanager: endsAt this far ahead while firing; 0: Alertmanager's resolve_timeout
    timeout: float = 10.0  # per attempt


@dataclass(frozen=True, slots=True)
class AlertsSection:
    sinks: tuple[SinkSection, ...] = ()
    attempts: int = 5  # per alert and sink
    retry_for: float = 120.0  # no new attempt after this many seconds
    heartbeat_url: str = ""  # dead-man switch, pinged only after a pass that saw the engine
    heartbeat_url_env: str = ""
    heartbeat_url_file: str = ""
    heartbeat_interval: float = 60.0
    runbook_base: str = ""  # where the runbooks are published (a URL or directory); "" names runbooks/<page>.md
    blind_after: float = 60.0  # the page or a node not seen this long: a blind incident, alerted (docs/blind.md)


def check_restart(r: RestartSection, nodes: tuple[str, ...] = NODES) -> None:
    """Raises ValueError naming the key; ``nodes``: the node names a step may use."""
    for key in ("pre_start_timeout", "boot_timeout", "evidence_timeout", "budget_window", "down_after",
                "hold_max"):
        if not getattr(r, key) > 0:
            raise ValueError(f"restart.{key} must be greater than 0, got {getattr(r, key)!r}")
    if r.budget < 0 or r.backoff_initial < 0 or r.backoff_max < r.backoff_initial:
        raise ValueError("restart: budget and backoff_initial must be 0 or more, "
                          "and backoff_max at least backoff_initial")
    for i, step in enumerate(r.steps):
        where = f"restart.steps[{i}]"
        if step.kind not in STEP_KINDS:
            raise ValueError(f"{where}.kind: {step.kind!r} is not one of {', '.join(STEP_KINDS)}")
        if step.verb not in STEP_KINDS[step.kind]:
            raise ValueError(f"{where}.action: {step.kind} steps {'/'.join(STEP_KINDS[step.kind])}, "
                              f"not {step.action!r}")
        wanted = {"systemd": "units", "docker": "containers", "command": "argv"}[step.kind]
        for key in ("units", "containers", "argv"):
            given = bool(getattr(step, key))
            if given != (key == wanted):
                raise ValueError(f"{where}.{key}: a {step.kind} step " + ("needs" if key == wanted else "takes no")
                                  + f" {key}")
        if not step.timeout > 0:
            raise ValueError(f"{where}.timeout must be greater than 0, got {step.timeout!r}")
        if step.nodes and step.node != "local":
            raise ValueError(f"{where}: node and nodes both given (nodes runs the step on each of them at once; "
                             "node, on one)")
        if len(set(step.nodes)) != len(step.nodes):
            raise ValueError(f"{where}.nodes: a node named twice ({', '.join(step.nodes)})")
        for n, name in enumerate(step.on):
            if name not in nodes:
                key = f"nodes[{n}]" if step.nodes else "node"
                raise ValueError(f"{where}.{key}: unknown node {name!r} (known: {', '.join(nodes)}; name other "
                                 "nodes in [[nodes]])")
        check_transient(step, where)


def check_transient(step: StepSection, where: str) -> None:
    """``transient_unit`` and ``unit_properties`` of one step; raises ValueError naming the key."""
    if not step.transient_unit:
        if step.unit_properties:
            raise ValueError(f"{where}.unit_properties: only with transient_unit (they set up that unit)")
        return
    if step.kind != "command":
        raise ValueError(f"{where}.transient_unit: only a command step runs its argv as a transient unit")
    if not TRANSIENT_UNIT.fullmatch(step.transient_unit) or step.transient_unit == WATCHDOG_UNIT:
        raise ValueError(f"{where}.transient_unit: {step.transient_unit!r} is not a service name of its own "
                         "(letters, digits, ':_.-\\', ending in .service; not the watchdog's)")
    if step.verb not in ("start", "restart"):
        raise ValueError(f"{where}.action: a step with transient_unit starts its argv as that unit: start or "
                         f"restart, not {step.action!r} (stop it with a systemd step: units = "
                         f"[{step.transient_unit!r}])")
    for i, prop in enumerate(step.unit_properties):
        if not UNIT_PROPERTY.fullmatch(prop):
            raise ValueError(f"{where}.unit_properties[{i}]: {prop!r} is not one Name=value setting")


def check_alerts(a: AlertsSection) -> None:
    """Raises ValueError naming the key."""
    if a.attempts < 1 or not a.retry_for > 0 or not a.heartbeat_interval > 0:
        raise ValueError("alerts: attempts must be 1 or more, retry_for and heartbeat_interval above 0")
    if not a.blind_after > 0:
        raise ValueError(f"alerts.blind_after must be greater than 0, got {a.blind_after!r}")
    if sum(bool(x) for x in (a.heartbeat_url, a.heartbeat_url_env, a.heartbeat_url_file)) > 1:
        raise ValueError("alerts: give one of heartbeat_url, heartbeat_url_env, heartbeat_url_file")
    names: set[str] = set()
    for i, sink in enumerate(a.sinks):
        where = f"alerts.sinks[{i}]"
        if sink.kind not in ("webhook", "slack", "alertmanager"):
            raise ValueError(f"{where}.kind: {sink.kind!r} is not one of webhook, slack, alertmanager")
        if sum(bool(x) for x in (sink.url, sink.url_env, sink.url_file)) != 1:
            raise ValueError(f"{where}: give exactly one of url, url_env, url_file")
        if (sink.secret_env or sink.secret_file) and sink.kind != "webhook":
            raise ValueError(f"{where}: only webhook sinks sign their bodies (secret_env/secret_file)")
        if not sink.timeout > 0 or sink.firing_ttl < 0:
            raise ValueError(f"{where}: timeout must be above 0 and firing_ttl 0 or more")
        name = sink.name or sink.kind
        if name in names:
            raise ValueError(f"{where}.name: {name!r} names two sinks; give each its own name")
        names.add(name)
