"""Operator switches and the daemon's status: ``watchdog pause / resume / reset / status``.

The switches are written to ``STATE_DIR/control.json`` (see `watchdog.act.state`); the running daemon reads that file
every pass, so they take effect within a second, and they survive restarts of the watchdog and of the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from watchdog.act.state import load_control, load_status, save_control
from watchdog.config.load import Config
from watchdog.evidence.collect.deadlines import lines as deadline_lines

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1h30m``, ``1d`` -> seconds."""
    t = text.strip().lower()
    try:
        seconds = float(t)
    except ValueError:
        parts = _DURATION.findall(t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise ValueError(f"not a duration: {text!r} (e.g. 90s, 30m, 2h, 1h30m)") from None
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not 0 < seconds < float("inf"):
        raise ValueError(f"a duration must be above 0, got {text!r}")
    return seconds


def _duration_arg(text: str) -> float:
    """``--for``: a bad duration is an argument error (exit 64), with parse_duration's message."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _when(wall: float | None) -> str:
    if wall is None:
        return "until `watchdog resume`"
    return datetime.fromtimestamp(wall, UTC).strftime("until %Y-%m-%d %H:%M:%S UTC")


def cmd_pause(cfg: Config, args: argparse.Namespace) -> int:
    state_dir, now = Path(cfg.state.dir), time.time()
    until = now + args.duration if args.duration else None
    control = replace(load_control(state_dir), paused=True, paused_until=until, reason=args.reason or "",
                      paused_at=now)
    save_control(state_dir, control)
    print(f"paused {_when(until)}: no restart, no alert; stacks and events are still taken")
    return 0


def cmd_resume(cfg: Config, _args: argparse.Namespace) -> int:
    state_dir = Path(cfg.state.dir)
    control = load_control(state_dir)
    save_control(state_dir, replace(control, paused=False, paused_until=None, reason=""))
    print("resumed" if control.is_paused(time.time()) else "was not paused")
    return 0


def cmd_reset(cfg: Config, _args: argparse.Namespace) -> int:
    state_dir = Path(cfg.state.dir)
    save_control(state_dir, replace(load_control(state_dir), reset_at=time.time()))
    print("restart budget reset; a give-up is cleared: the watchdog acts again")
    return 0


def status_of(cfg: Config, now: float) -> tuple[int, dict[str, Any]]:
    """(exit code, status): 0 when the daemon wrote its status within a few passes, 3 when it did not."""
    state_dir = Path(cfg.state.dir)
    status = load_status(state_dir, now) or {}
    control = load_control(state_dir)
    age = now - float(status["confirmed"]) if status else None
    fresh = age is not None and age <= max(30.0, 5 * float(status.get("interval", 1.0)))
    status = {**status, "daemon": "running" if fresh else "not running", "status_age_seconds":
              None if age is None else round(age, 1), "paused": control.is_paused(now),
              "paused_until": control.paused_until if control.is_paused(now) else None}
    return (0 if fresh else 3), status


def cmd_status(cfg: Config, args: argparse.Namespace) -> int:
    code, s = status_of(cfg, time.time())
    if args.json:
        print(json.dumps(s, indent=2))
        return code
    if s["status_age_seconds"] is None:
        print(f"no status in {cfg.state.dir}: the daemon has not run with this state directory")
        return code
    print(f"daemon: {s['daemon']} (pid {s.get('pid')}, last pass {s['status_age_seconds']:.0f}s ago), "
          f"stack {s.get('stack')} at {s.get('url')}")
    for e in s.get("engines", []):
        print(f"  engine {e['engine']}: {e['state']} for {e['for_seconds']:.0f}s: {e['reason']}")
    inc = s.get("incident")
    if inc:
        print(f"incident {inc['id']}: {inc['kind']}, {inc['phase']}, {inc['attempts']} restart(s)"
              + (f", bundle {inc['bundle']}" if inc.get("bundle") else ""))
    else:
        print("incident: none open")
    for b in s.get("blind") or []:  # what the watchdog cannot see (a blind incident once it lasts: docs/blind.md)
        print(f"blind: {b['unseen']} not seen for {b['seconds']:.0f}s: {b['why']}"
              + (f" (incident {b['incident']})" if b.get("incident") else ""))
    rec = s.get("recovery")
    if rec:
        print(f"recovery: {rec['phase']} for {rec['seconds']:.0f}s, {rec['tries']} tries, last: {rec['last_try']}")
    paused = f"yes, {_when(s['paused_until'])}" if s["paused"] else "no"
    restart = "dry run" if s.get("dry_run") else ("configured" if s.get("restart_configured") else "not configured")
    print(f"restart: {restart}; budget: {s.get('budget_left')} of {s.get('budget')} left; paused: {paused}; "
          f"gave up: {'yes: ' + str(s['gave_up'].get('reason')) if s.get('gave_up') else 'no'}")
    if s.get("deadlines"):
        for line in deadline_lines(s["deadlines"]):
            print(line)
    return code


def add_commands(sub: Any, common: Any, config_of: Any) -> None:
    p = sub.add_parser("pause", help="maintenance: no restart and no alert until resumed (or for a while)")
    common(p, url=False, state_dir=True)
    p.add_argument("--for", dest="duration", type=_duration_arg, help="e.g. 30m, 2h (default: until `watchdog resume`)")
    p.add_argument("--reason", help="shown in `watchdog status`")
    p.set_defaults(func=lambda a: cmd_pause(config_of(a), a))
    r = sub.add_parser("resume", help="end a pause")
    common(r, url=False, state_dir=True)
    r.set_defaults(func=lambda a: cmd_resume(config_of(a), a))
    z = sub.add_parser("reset", help="reset the restart budget and clear a give-up")
    common(z, url=False, state_dir=True)
    z.set_defaults(func=lambda a: cmd_reset(config_of(a), a))
    s = sub.add_parser("status", help="what the running daemon is doing now")
    common(s, url=False, state_dir=True, as_json=True)
    s.set_defaults(func=lambda a: cmd_status(config_of(a), a))
