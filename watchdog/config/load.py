"""Typed, validated, immutable configuration, loaded from TOML.

Every key has a default, so the watchdog runs with no file at all. Unknown keys and wrong types are
rejected with the key named. Secrets are never written in the file: it names an environment variable
or a file that holds them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from watchdog.config.act import AlertsSection, RestartSection, SinkSection, StepSection, check_alerts, check_restart
from watchdog.config.gpu import GpuSection, check_gpu
from watchdog.config.nodes import NodeSection, check_nodes, node_names
from watchdog.core.types import HttpLimits, base_url
from watchdog.judge.track import Thresholds


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file and key."""


class Secret:
    """A value that never shows itself in logs, reprs or bundles."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(***)" if self._value else "Secret()"

    def __bool__(self) -> bool:
        return bool(self._value)


@dataclass(frozen=True, slots=True)
class EngineSection:
    url: str = "http://127.0.0.1:8000"
    name: str = "vllm"  # how events and metrics name this engine stack


@dataclass(frozen=True, slots=True)
class ScrapeSection:
    interval: float = 1.0
    connect_timeout: float = 2.0
    read_timeout: float = 5.0
    deadline: float = 10.0
    max_bytes: int = 16 * 1024 * 1024

    def limits(self) -> HttpLimits:
        return HttpLimits(self.connect_timeout, self.read_timeout, self.deadline, self.max_bytes)


@dataclass(frozen=True, slots=True)
class JudgeSection:
    suspect_after: float = 5.0
    stall_window: float = 40.0


@dataclass(frozen=True, slots=True)
class ProbeSection:
    enabled: bool = True
    interval: float = 10.0
    retry: float = 5.0
    timeout: float = 60.0
    model: str = ""  # empty: the first model /v1/models lists
    api_key_env: str = "VLLM_API_KEY"  # environment variable holding the server's --api-key, if any
    api_key_file: str = ""  # or a file holding it (takes precedence)


@dataclass(frozen=True, slots=True)
class CaptureSection:
    enabled: bool = True  # take stacks on suspicion and on a freeze
    pyspy: str = ""  # empty: the one beside the watchdog's python, else PATH
    timeout: float = 10.0  # per py-spy dump
    rounds: int = 2
    gap: float = 2.0  # seconds between the rounds
    native: bool = False
    locals: bool = False  # off: locals hold prompts and secrets
    process_prefix: str = "VLLM::"  # vLLM's VLLM_PROCESS_NAME_PREFIX
    title_filter: str = ""  # only processes whose title contains this (several engines on a host)
    log_file: str = ""  # the engine's log: a file, or
    journal_unit: str = ""  # a systemd unit (journalctl -u), or
    docker_container: str = ""  # a container (docker logs)
    log_lines: int = 200


@dataclass(frozen=True, slots=True)
class IncidentsSection:
    max_count: int = 50
    max_bytes: int = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ExporterSection:
    listen: str = "127.0.0.1"
    port: int = 9830  # 0 turns the exporter off
    # /livez fails once an engine has been frozen or down this long (the kubelet's restart as the last resort)
    live_after: float = 300.0


@dataclass(frozen=True, slots=True)
class StateSection:
    dir: str = "/var/lib/engine-watchdog"
    trace_max_bytes: int = 64 * 1024 * 1024  # rolling trace of what the judgement saw; 0 turns it off
    events_max_bytes: int = 16 * 1024 * 1024  # events.jsonl rolls over to .1 past this; 0: never


@dataclass(frozen=True, slots=True)
class Config:
    engine: EngineSection = field(default_factory=EngineSection)
    scrape: ScrapeSection = field(default_factory=ScrapeSection)
    judge: JudgeSection = field(default_factory=JudgeSection)
    probe: ProbeSection = field(default_factory=ProbeSection)
    capture: CaptureSection = field(default_factory=CaptureSection)
    gpu: GpuSection = field(default_factory=GpuSection)
    incidents: IncidentsSection = field(default_factory=IncidentsSection)
    exporter: ExporterSection = field(default_factory=ExporterSection)
    state: StateSection = field(default_factory=StateSection)
    restart: RestartSection = field(default_factory=RestartSection)
    alerts: AlertsSection = field(default_factory=AlertsSection)
    nodes: tuple[NodeSection, ...] = ()  # the stack's other nodes ([[nodes]]; watchdog.nodes reaches them)
    source: str = "<defaults>"

    def thresholds(self) -> Thresholds:
        return Thresholds(
            suspect_after=self.judge.suspect_after,
            stall_window=self.judge.stall_window,
            probe_interval=self.probe.interval if self.probe.enabled else 0.0,
            probe_retry=self.probe.retry,
        )

    def api_key(self) -> Secret:
        if self.probe.api_key_file:
            try:
                return Secret(Path(self.probe.api_key_file).read_text().strip())
            except OSError as e:
                raise ConfigError(f"{self.source}: probe.api_key_file: cannot read {self.probe.api_key_file}: "
                                  f"{e.strerror}") from None
        return Secret(os.environ.get(self.probe.api_key_env, "")) if self.probe.api_key_env else Secret("")

    def secret(self, key: str, env: str, file: str) -> Secret:
        """A secret from a file (first) or an environment variable; ``key`` names the setting in errors."""
        if file:
            try:
                return Secret(Path(file).read_text().strip())
            except OSError as e:
                raise ConfigError(f"{self.source}: {key}_file: cannot read {file}: {e.strerror}") from None
        if env:
            value = os.environ.get(env, "")
            if not value:
                raise ConfigError(f"{self.source}: {key}_env: the environment variable {env} is not set")
            return Secret(value)
        return Secret("")

    def with_overrides(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys replaced, validated like the file (used by command-line flags)."""
        raw: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}
        raw["nodes"] = [dataclasses.asdict(n) for n in self.nodes]
        for name, values in sections.items():
            if name not in raw:
                raise ConfigError(f"unknown config section {name!r}")
            raw[name].update({k: v for k, v in values.items() if v is not None})
        return _build(raw, self.source)


_SECTIONS: dict[str, type] = {
    "engine": EngineSection,
    "scrape": ScrapeSection,
    "judge": JudgeSection,
    "probe": ProbeSection,
    "capture": CaptureSection,
    "incidents": IncidentsSection,
    "exporter": ExporterSection,
    "state": StateSection,
    "restart": RestartSection,
    "alerts": AlertsSection,
    "gpu": GpuSection,
}
_TABLES: dict[str, type] = {"restart.steps": StepSection, "alerts.sinks": SinkSection}


def load(path: str | os.PathLike[str] | None) -> Config:
    """Load and validate a config file; None means all defaults."""
    if path is None:
        return Config()
    source = str(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    return _build(raw, source)


def _build(raw: dict[str, Any], source: str) -> Config:
    sections: dict[str, Any] = {}
    for name, values in raw.items():
        if name == "nodes":  # the one top-level list of tables: [[nodes]]
            if not isinstance(values, list | tuple) or not all(isinstance(v, dict) for v in values):
                raise ConfigError(f"{source}: nodes must be a list of tables ([[nodes]]), got {type_name(values)}")
            sections[name] = tuple(parse_section(NodeSection, f"nodes[{i}]", v, source) for i, v in enumerate(values))
            continue
        cls = _SECTIONS.get(name)
        if cls is None:
            raise ConfigError(f"{source}: unknown key {name!r} (known sections: {', '.join(_SECTIONS)}, nodes)")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: {name} must be a table ([{name}]), got {type_name(values)}")
        sections[name] = parse_section(cls, name, values, source)
    cfg = Config(**sections, source=source)
    _validate(cfg)
    return cfg


def parse_section(cls: type, name: str, values: dict[str, Any], source: str) -> Any:
    """The dataclass ``cls`` from one TOML table: unknown keys and wrong types a ConfigError naming the key."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        table = _TABLES.get(f"{name}.{key}")
        if table is not None:
            if not isinstance(value, list | tuple) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"{source}: {name}.{key} must be a list of tables ([[{name}.{key}]]), "
                                  f"got {type_name(value)}")
            kwargs[key] = tuple(parse_section(table, f"{name}.{key}[{i}]", v, source) for i, v in enumerate(value))
        else:
            kwargs[key] = _typed(hints[key], value, f"{source}: {name}.{key}")
    return cls(**kwargs)


def _typed(hint: Any, value: Any, where: str) -> Any:
    if isinstance(hint, types.UnionType):
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {type_name(value)} {shown(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected a whole number, got {type_name(value)} {shown(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {type_name(value)} {shown(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {type_name(value)} {shown(value)}")
        return tuple(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type_name(value)} {shown(value)}")
        return value
    raise ConfigError(f"{where}: unsupported setting type {hint!r}")  # pragma: no cover - a bug in this module


def shown(value: Any, limit: int = 60) -> str:
    """A wrong value as an error names it: its repr, cut to ``limit`` characters (a pasted page stays one line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def type_name(value: Any) -> str:
    """A TOML value's type in words, for a ConfigError."""
    return {bool: "a boolean", int: "a whole number", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _validate(cfg: Config) -> None:
    src = cfg.source

    def positive(key: str, value: float) -> None:
        if not value > 0:
            raise ConfigError(f"{src}: {key} must be greater than 0, got {value!r}")

    try:
        base_url(cfg.engine.url)
    except ValueError as e:  # its words, the URL in them cut short (a pasted URL with a long query)
        raise ConfigError(f"{src}: engine.url: {str(e).replace(repr(cfg.engine.url), shown(cfg.engine.url))}") \
            from None
    for key in ("interval", "connect_timeout", "read_timeout", "deadline"):
        positive(f"scrape.{key}", getattr(cfg.scrape, key))
    positive("scrape.max_bytes", cfg.scrape.max_bytes)
    positive("judge.suspect_after", cfg.judge.suspect_after)
    positive("judge.stall_window", cfg.judge.stall_window)
    if cfg.judge.suspect_after > cfg.judge.stall_window:
        raise ConfigError(f"{src}: judge.suspect_after ({cfg.judge.suspect_after:g}) must not exceed "
                          f"judge.stall_window ({cfg.judge.stall_window:g})")
    for key in ("interval", "retry", "timeout"):
        positive(f"probe.{key}", getattr(cfg.probe, key))
    positive("capture.timeout", cfg.capture.timeout)
    positive("capture.rounds", cfg.capture.rounds)
    if cfg.capture.gap < 0:
        raise ConfigError(f"{src}: capture.gap must be 0 or more")
    positive("incidents.max_count", cfg.incidents.max_count)
    positive("incidents.max_bytes", cfg.incidents.max_bytes)
    if sum(bool(x) for x in (cfg.capture.log_file, cfg.capture.journal_unit, cfg.capture.docker_container)) > 1:
        raise ConfigError(f"{src}: capture: give one of log_file, journal_unit, docker_container")
    if not 0 <= cfg.exporter.port <= 65535:
        raise ConfigError(f"{src}: exporter.port must be 0..65535, got {cfg.exporter.port}")
    positive("exporter.live_after", cfg.exporter.live_after)
    for key in ("trace_max_bytes", "events_max_bytes"):
        if getattr(cfg.state, key) < 0:
            raise ConfigError(f"{src}: state.{key} must be 0 or more")
    for name, check in (("alerts", check_alerts), ("gpu", check_gpu)):
        try:
            check(getattr(cfg, name))
        except ValueError as e:
            raise ConfigError(f"{src}: {e}") from None
    try:
        check_nodes(cfg.nodes, cfg.capture)
        check_restart(cfg.restart, node_names(cfg.nodes))
    except ValueError as e:
        raise ConfigError(f"{src}: {e}") from None
