"""The agent's own config on its node (default ``/etc/engine-watchdog/agent.toml``): what this node lets the watchdog
do. The head asks; this file decides. Unknown keys are rejected with the key named, like the watchdog's config.

```toml
process_prefix = "VLLM::"
journal_unit = "vllm-worker.service"    # the one log the head may read here (or log_file / docker_container):
                                       # the head's [[nodes]] entry may name it (exactly this one) or none
pre_start = ["/bin/sh", "-c", "sync && echo 3 > /proc/sys/vm/drop_caches"]
remove_shm = true                      # the head may remove stale psm_* / sem.mp-* segments in /dev/shm
audit_log = "/var/log/engine-watchdog/agent.log"
[[steps]]                              # the restart steps the head may run here, as in [[restart.steps]]
kind = "systemd"
action = "stop"
units = ["vllm-worker.service"]
```
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from watchdog.config.act import RestartSection, StepSection, check_restart
from watchdog.config.load import ConfigError, parse_section, type_name
from watchdog.config.restart_plan import plan

DEFAULT_PATH = "/etc/engine-watchdog/agent.toml"


@dataclass(frozen=True, slots=True)
class _Top:
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

    def build(self, steps: tuple[StepSection, ...], source: str) -> AgentConfig:
        return AgentConfig(**{f.name: getattr(self, f.name) for f in fields(_Top)}, steps=steps, source=source)


@dataclass(frozen=True, slots=True)
class AgentConfig(_Top):
    """The agent's config: the top-level keys and the restart steps this node allows."""

    steps: tuple[StepSection, ...] = field(default_factory=tuple)
    source: str = "<defaults>"

    def allowed(self) -> set[tuple[str, ...]]:
        """Every argv this node runs for the head: its steps' commands and its pre-start hook (docker --time free)."""
        section = RestartSection(steps=self.steps, pre_start=self.pre_start)
        return {normal(c.argv) for c in plan(section)} | ({tuple(self.pre_start)} if self.pre_start else set())


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
    cfg: AgentConfig = parse_section(_Top, "agent", raw, path).build(parsed, path)
    try:
        check_restart(RestartSection(steps=cfg.steps), ("local",))
    except ValueError as e:
        raise ConfigError(f"{path}: {e}".replace("restart.steps", "steps")) from None
    if sum(bool(x) for x in (cfg.log_file, cfg.journal_unit, cfg.docker_container)) > 1:
        raise ConfigError(f"{path}: give one of log_file, journal_unit, docker_container")
    if not Path(cfg.shm_dir).is_absolute():
        raise ConfigError(f"{path}: shm_dir must be an absolute path")
    return cfg


