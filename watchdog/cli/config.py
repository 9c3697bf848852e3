"""Which config file a verb reads, ``watchdog config check [--config PATH] [--json]`` and ``watchdog config get
KEY``.

The file is ``--config PATH``, else ``$ENGINE_WATCHDOG_CONFIG``, else /etc/engine-watchdog/config.toml (where the
install puts it and the shipped unit reads it). A file named by the flag or the variable must exist. The default
one may be missing: the verbs that work on the built-in defaults (check, run, dump, status, ...) use them and say
so on stderr; the verbs that need the file (``nodes``, ``config check``) fail with exit 64 instead of succeeding on
an empty config. ``ENGINE_WATCHDOG_CONFIG=/dev/null`` reads no file and says nothing: the built-in defaults.

``config check`` loads the file with the real loader and reads every secret the daemon reads when it starts (the
probe's API key file, each sink's URL and signing secret, the heartbeat URL; the values are dropped): exit 0 and
``config OK: PATH (1 engine, 2 nodes, 3 restart steps)``, or exit 64 and the error with its key, the daemon's own
exit on that config. Nodes count this host and each ``[[nodes]]`` entry.

``config get KEY`` prints one value of the config the verbs run with, defaults filled in (``engine.url``,
``state.dir``, ``capture.journal_unit``, ``nodes.0.host``): for scripts and the runbooks' variables. A scalar as
it is, anything else as JSON; an unknown key is exit 64 with the key named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, TextIO

from watchdog.config.load import Config, ConfigError, load

DEFAULT_CONFIG = "/etc/engine-watchdog/config.toml"
CONFIG_ENV = "ENGINE_WATCHDOG_CONFIG"
CONFIG_HELP = f"TOML config file (default ${CONFIG_ENV}, else {DEFAULT_CONFIG})"
EXIT_OK, EXIT_USAGE = 0, 64


@dataclass(frozen=True, slots=True)
class ConfigPath:
    path: str
    default: bool  # neither --config nor the environment variable named it


def config_path(given: str | None, environ: Mapping[str, str] | None = None,
                default: str = DEFAULT_CONFIG) -> ConfigPath:
    if given:
        return ConfigPath(given, False)
    named = (os.environ if environ is None else environ).get(CONFIG_ENV, "")
    return ConfigPath(named, False) if named else ConfigPath(default, True)


def load_config(given: str | None, *, needs_file: bool = False, environ: Mapping[str, str] | None = None,
                default: str = DEFAULT_CONFIG, note: TextIO | None = None) -> Config:
    """The config a verb runs with (see the module's docstring); a ConfigError when it cannot be used."""
    where = config_path(given, environ, default)
    if where.default and not os.path.exists(where.path):
        if needs_file:
            raise ConfigError(f"{where.path}: no such config file (--config PATH or {CONFIG_ENV}=PATH names "
                              "another)")
        print(f"watchdog: {where.path} does not exist: the built-in defaults are used (--config PATH or "
              f"{CONFIG_ENV}=PATH names a file)", file=note or sys.stderr)
        return Config()
    return load(where.path)


def read_secrets(cfg: Config) -> int:
    """Reads every secret the daemon reads at start, as it reads them (an unset variable or an unreadable file is
    the ConfigError it exits 64 on); how many were read. The values are dropped here."""
    read = [cfg.api_key()]
    for i, s in enumerate(cfg.alerts.sinks):
        key = f"alerts.sinks[{i}]"
        if not s.url:
            read.append(cfg.secret(f"{key}.url", s.url_env, s.url_file))
        if s.kind == "webhook":
            read.append(cfg.secret(f"{key}.secret", s.secret_env, s.secret_file))
    a = cfg.alerts
    if not a.heartbeat_url:
        read.append(cfg.secret("alerts.heartbeat_url", a.heartbeat_url_env, a.heartbeat_url_file))
    return sum(bool(s) for s in read)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def cmd_config_check(args: argparse.Namespace) -> int:
    where = config_path(args.config)
    try:
        cfg = load_config(args.config, needs_file=True)
        secrets = read_secrets(cfg)
    except ConfigError as e:
        if args.json:
            print(json.dumps({"config": where.path, "valid": False, "error": str(e)}, indent=2))
        print(f"watchdog: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    nodes = ["local", *(n.name for n in cfg.nodes)]
    steps = len(cfg.restart.steps)
    if args.json:
        out: dict[str, Any] = {"config": where.path, "valid": True, "error": None, "engines": 1, "nodes": nodes,
                               "restart_steps": steps, "alert_sinks": len(cfg.alerts.sinks), "secrets_read": secrets,
                               "dry_run": cfg.restart.dry_run}
        print(json.dumps(out, indent=2))
    else:
        print(f"config OK: {where.path} ({_count(1, 'engine')}, {_count(len(nodes), 'node')}, "
              f"{_count(steps, 'restart step')})")
    return EXIT_OK


def config_value(cfg: Config, key: str) -> object:
    """The value at a dotted ``key`` (``section.field``, a list's items by index); a ConfigError naming it."""
    value: object = cfg
    for i, part in enumerate(key.split(".")):
        where = ".".join(key.split(".")[:i + 1])
        if isinstance(value, tuple | list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif is_dataclass(value) and not part.startswith("_") and hasattr(value, part):
            value = getattr(value, part)
        else:
            raise ConfigError(f"no config key {where!r}" + ("" if i else " (sections: " + ", ".join(
                f for f in type(cfg).__dataclass_fields__) + ")"))
    return value


def cmd_config_get(args: argparse.Namespace) -> int:
    try:
        value = config_value(load_config(args.config), args.key)
    except ConfigError as e:
        print(f"watchdog: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    scalar = value is None or isinstance(value, str | int | float | bool)
    print(("" if value is None else value) if scalar else json.dumps(value, default=str))
    return EXIT_OK


def add_commands(sub: Any) -> None:
    c = sub.add_parser("config", help="the config file: `config check` validates it (exit 0, or 64 naming the key); "
                                      "`config get KEY` prints one value")
    more = c.add_subparsers(dest="config_command", metavar="{check,get}", required=True)
    chk = more.add_parser("check", help="load the config with the daemon's loader and read its secrets: exit 0 "
                                        "valid, 64 not (the key named); before a restart, in ExecStartPre")
    chk.add_argument("--config", help=CONFIG_HELP)
    chk.add_argument("--json", action="store_true", help="machine-readable output")
    chk.set_defaults(func=cmd_config_check)
    get = more.add_parser("get", help="print one value of the config the verbs run with, defaults filled in "
                                      "(engine.url, state.dir, capture.journal_unit, ...)")
    get.add_argument("key", help="a dotted key: section.field, list items by index (nodes.0.host)")
    get.add_argument("--config", help=CONFIG_HELP)
    get.set_defaults(func=cmd_config_get)
