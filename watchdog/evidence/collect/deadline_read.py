"""Read the engine processes' environment and command line (/proc/PID/environ and cmdline, through psutil) for the
timeouts that destroy the evidence, and report them against the watchdog's confirmation time
(`watchdog.evidence.collect.deadlines`).

Only the names in `deadlines.KNOWN` are kept from an environment: the rest (API keys, tokens) never leaves here.
"""

from __future__ import annotations

from collections.abc import Sequence

import psutil

from watchdog.config.load import Config
from watchdog.core.processes import EngineProcess
from watchdog.evidence.collect.deadlines import KNOWN, DeadlineReport, ProcessSettings, confirm_seconds, report
from watchdog.evidence.collect.discover import discover

_ENV_NAMES = {k.name for k in KNOWN if not k.name.startswith("--")}


def read_settings(processes: Sequence[EngineProcess]) -> list[ProcessSettings]:
    out = []
    for p in processes:
        label = p.title or str(p.role)
        env: dict[str, str] = {}
        argv: list[str] = []
        error = ""
        try:
            proc = psutil.Process(p.pid)
            argv = proc.cmdline()
            env = {k: v for k, v in proc.environ().items() if k in _ENV_NAMES}
        except psutil.AccessDenied:
            error = "its environment cannot be read (run the watchdog as root or as the engine's user)"
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            error = "it exited while being read"
        out.append(ProcessSettings(p.pid, label, env, argv, error))
    return out


def config_confirm_seconds(cfg: Config) -> float:
    c = cfg.capture
    return confirm_seconds(cfg.judge.suspect_after, cfg.judge.stall_window, cfg.scrape.interval, c.rounds, c.gap,
                           c.timeout)


def read_deadlines(cfg: Config, url: str, processes: Sequence[EngineProcess] | None = None) -> DeadlineReport:
    """The engine behind ``url`` (or the processes given): its deadlines against this config's confirmation time."""
    if processes is None:
        processes = discover(url, cfg.capture.process_prefix, cfg.capture.title_filter,
                             container=cfg.capture.docker_container)
    return report(read_settings(processes), config_confirm_seconds(cfg))
