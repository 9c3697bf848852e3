"""The agent's own config on its node (default ``/etc/engine-watchdog/agent.toml``): what this node lets the watchdog
do. The head asks; this file decides. Unknown keys are rejected with the key named, like the watchdog's config.

```toml
process_prefix = "VLLM::"
journal_unit = "vllm-worker.service"    # the one log the head may read here (or log_file / docker_container):
                                       # the head's [[nodes]] entry may name it (exactly this one) or none
pre_start = ["/bin/sh", "-c", "sync && echo 3 > /proc/sys/vm/drop_caches"]
remove_shm = true                      # the head may remove stale psm_* / sem.mp-* segments in /dev/shm
audit_log = "/var/log/engine-watchdog/agent.log"   # JSON lines, one record per line
engine_users = ["root"]                # which titled processes are the engine's: owned by these users, or
engine_units = []                      # in these systemd units (besides the ones its steps and log name), or
engine_containers = []                 # in these Docker containers (names or ids; besides its steps' and log's)
allow_locals = false                   # py-spy --locals (prompts and secrets) for the head: off unless said
[[steps]]                              # the restart steps the head may run here, as in [[restart.steps]]
kind = "systemd"
action = "stop"
units = ["vllm-worker.service"]
```
"""

from __future__ import annotations

import pwd
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from watchdog.config.act import RestartSection, StepSection, check_restart
from watchdog.config.load import ConfigError, parse_section, type_name
from watchdog.config.restart_plan import plan
from watchdog.nodes.identity import Identity, check_identity

DEFAULT_PATH = "/etc/engine-watchdog/agent.toml"


@dataclass(frozen=True, slots=True)
class AgentKeys:
    """The top-level keys (steps aside), typed and checked by the watchdog's own config loader."""

    process_prefix: str = "VLLM::"
    title_filter: str = ""
    pyspy: str = ""
    capture_timeout: float = 10.0
    log_file: str = ""
    journal_unit: str = ""
    docker_container: str = ""
    pre_start: tuple[str, ...] = ()
    pre_start_timeout: float = 120.0
    remove_shm: bool = False
    shm_dir: str = "/dev/shm"  # noqa: S108 - where POSIX shared memory lives, not a temp file
    audit_log: str = "/var/log/engine-watchdog/agent.log"
    request_timeout: float = 10.0  # seconds for the head's request to arrive whole; then refused
    # which processes with the engine's title are the engine's (`watchdog.nodes.identity`): any one of these
    engine_users: tuple[str, ...] = ("root",)  # owned by (real, effective and saved uid); [] : owner is not enough
    engine_units: tuple[str, ...] = ()  # in a systemd system unit (besides the units its steps and log name)
    engine_containers: tuple[str, ...] = ()  # in a Docker container, name or id (besides its steps' and log's)
    engine_cgroups: tuple[str, ...] = ()  # in a cgroup under one of these paths ("/kubepods.slice/")
    allow_native: bool = True  # py-spy --native when the head asks
    allow_locals: bool = False  # py-spy --locals when the head asks (locals hold prompts and secrets)

    def build(self, steps: tuple[StepSection, ...], source: str) -> AgentConfig:
        return AgentConfig(**{f.name: getattr(self, f.name) for f in fields(AgentKeys)}, steps=steps, source=source)


@dataclass(frozen=True, slots=True)
class AgentConfig(AgentKeys):
    """The agent's config: the top-level keys and the restart steps this node allows."""

    steps: tuple[StepSection, ...] = field(default_factory=tuple)
    source: str = "<defaults>"

    def allowed(self) -> set[tuple[str, ...]]:
        """Every argv this node runs for the head: its steps' commands and its pre-start hook (docker --time: N)."""
        return set(self._commands())

    def _commands(self) -> dict[tuple[str, ...], tuple[int | None, float]]:
        """normal argv -> (docker's planned --time or None, the most seconds it may run)."""
        section = RestartSection(steps=self.steps, pre_start=self.pre_start,
                                 pre_start_timeout=self.pre_start_timeout)
        out: dict[tuple[str, ...], tuple[int | None, float]] = {}
        if self.pre_start:
            out[tuple(self.pre_start)] = (None, self.pre_start_timeout)
        for c in plan(section):
            stop_time = int(c.argv[c.argv.index("--time") + 1]) if c.kind == "docker" and "--time" in c.argv else None
            known = out.get(normal(c.argv), (None, 0.0))
            out[normal(c.argv)] = (max(stop_time or 0, known[0] or 0) or None, max(c.timeout, known[1]))
        return out

    def permits(self, argv: tuple[str, ...]) -> tuple[tuple[str, ...], float] | None:
        """(the argv to run, its time limit here) when this node runs ``argv`` for the head, else None. Docker's
        ``--time N`` must be a whole number from 1 to the step's own (a larger one is lowered to it: the head only
        ever lowers it); the time limit is the step's own (or the hook's)."""
        known = self._commands().get(normal(argv)) if argv else None
        if known is None:
            return None
        stop_time, limit = known
        if stop_time is None:
            return argv, limit
        at = argv.index("--time") + 1
        if not DOCKER_TIME.match(argv[at]):
            return None
        return (*argv[:at], str(min(int(argv[at]), stop_time)), *argv[at + 1:]), limit

    def identity(self) -> Identity:
        """Which processes with the engine's title are the engine's: the owners, units, containers and cgroups this
        config names, with the units and containers its own steps and log name."""
        units = [*self.engine_units, *(u for s in self.steps if s.kind == "systemd" for u in s.units)]
        containers = [*self.engine_containers, *(c for s in self.steps if s.kind == "docker" for c in s.containers)]
        return Identity(frozenset(uid_of(u) for u in self.engine_users),
                        tuple(dict.fromkeys([*units, *([self.journal_unit] if self.journal_unit else [])])),
                        tuple(dict.fromkeys([*containers, *([self.docker_container] if self.docker_container
                                                           else [])])),
                        self.engine_cgroups)


DOCKER_TIME = re.compile(r"^[1-9][0-9]{0,5}$")


def uid_of(user: str) -> int:
    """A user name's uid (a number is taken as a uid); KeyError when there is no such user."""
    return int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid


def normal(argv: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """An argv with docker's ``--time N`` value blanked (the head lowers it to fit its step's time left)."""
    out = tuple(argv)
    if out[:1] == ("docker",) and "--time" in out:
        at = out.index("--time") + 1
        out = (*out[:at], "N", *out[at + 1:])
    return out


def load_agent_config(path: str) -> AgentConfig:
    try:
        with open(path, "rb") as f:
            raw: dict[str, Any] = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such agent config file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    steps = raw.pop("steps", [])
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise ConfigError(f"{path}: steps must be a list of tables ([[steps]]), got {type_name(steps)}")
    parsed = tuple(parse_section(StepSection, f"steps[{i}]", s, path) for i, s in enumerate(steps))
    cfg: AgentConfig = parse_section(AgentKeys, "agent", raw, path).build(parsed, path)
    try:
        check_restart(RestartSection(steps=cfg.steps), ("local",))
    except ValueError as e:
        raise ConfigError(f"{path}: {e}".replace("restart.steps", "steps")) from None
    if sum(bool(x) for x in (cfg.log_file, cfg.journal_unit, cfg.docker_container)) > 1:
        raise ConfigError(f"{path}: give one of log_file, journal_unit, docker_container")
    if not Path(cfg.shm_dir).is_absolute():
        raise ConfigError(f"{path}: shm_dir must be an absolute path")
    if not cfg.request_timeout > 0 or not cfg.capture_timeout > 0:
        raise ConfigError(f"{path}: request_timeout and capture_timeout must be greater than 0")
    for user in cfg.engine_users:
        try:
            uid_of(user)
        except KeyError:
            raise ConfigError(f"{path}: engine_users: no user {user!r} on this node") from None
    bad = check_identity(cfg.identity())
    if bad:
        raise ConfigError(f"{path}: {bad}")
    return cfg


