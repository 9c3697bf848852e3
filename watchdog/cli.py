"""The `watchdog` command: check, run, record, replay; dump, explain, incidents, show, report; pause, resume, reset,
status."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from watchdog import __version__
from watchdog.act import commands as operate
from watchdog.act.state import iso
from watchdog.config.load import Config, ConfigError, load
from watchdog.evidence import commands as triage
from watchdog.judge.judge import worst
from watchdog.scrape.trace import TraceError, TraceWriter, read_trace, replay
from watchdog.service.daemon import Daemon
from watchdog.service.sdnotify import setup_logging
from watchdog.service.watcher import build_watcher
from watchdog.types import State, Verdict

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FROZEN, EXIT_DOWN, EXIT_UNKNOWN, EXIT_USAGE, EXIT_SOFTWARE, EXIT_IOERR = 0, 1, 2, 3, 64, 70, 74
_EXIT_BY_STATE = {State.IDLE: EXIT_OK, State.WORKING: EXIT_OK, State.FROZEN: EXIT_FROZEN, State.DOWN: EXIT_DOWN}
_SETTLED = {State.IDLE, State.DOWN, State.BLIND}


def clashing_distribution() -> str | None:
    """The unrelated PyPI `watchdog` (filesystem events) shares our import name. Say so if it is installed here."""
    try:
        dist = metadata.distribution("watchdog")
    except metadata.PackageNotFoundError:
        return None
    return f"watchdog {dist.version}"


def _config(args: argparse.Namespace) -> Config:
    cfg = load(args.config)
    engine: dict[str, Any] = {"url": getattr(args, "url", None)}
    state: dict[str, Any] = {"dir": str(args.state_dir) if getattr(args, "state_dir", None) else None}
    exporter: dict[str, Any] = {"port": getattr(args, "metrics_port", None)}
    restart: dict[str, Any] = {"dry_run": True if getattr(args, "dry_run", False) else None}
    return cfg.with_overrides(engine=engine, state=state, exporter=exporter, restart=restart)


def _verdict_json(v: Verdict, now: float) -> dict[str, Any]:
    return {
        "engine": v.engine, "state": v.state.value, "reason": v.reason, "model": v.model,
        "for_seconds": round(now - v.since, 1), "stalled_seconds": round(v.stalled_for, 1),
        "seconds_since_progress": None if v.last_progress is None else round(now - v.last_progress, 1),
        "incarnation": v.incarnation,
    }


def cmd_check(args: argparse.Namespace) -> int:
    cfg = _config(args)
    watcher = build_watcher(cfg)
    started = watcher.clock()
    deadline = started + args.seconds
    progress_seen: set[str] = set()
    while True:
        t0 = watcher.clock()
        watcher.tick()
        verdicts = watcher.judge.verdicts()
        progress_seen |= {v.engine for v in verdicts if v.last_progress is not None and v.last_progress > started}
        settled = all(v.state in _SETTLED or (v.state == State.WORKING and v.engine in progress_seen)
                      for v in verdicts)
        probing = watcher.prober is not None and watcher.prober.in_flight
        if watcher.clock() >= deadline or (verdicts and settled and not probing):
            break
        time.sleep(max(0.0, min(cfg.scrape.interval - (watcher.clock() - t0), deadline - watcher.clock())))
    now = watcher.clock()
    verdicts = [_honest(v, v.engine in progress_seen, now - started) for v in watcher.judge.verdicts()]
    top = worst(verdicts)
    code = EXIT_UNKNOWN if top is None else _EXIT_BY_STATE.get(top.state, EXIT_UNKNOWN)
    if args.json:
        print(json.dumps({"url": watcher.fetcher.url if hasattr(watcher.fetcher, "url") else cfg.engine.url,
                          "time": iso(time.time()), "watched_seconds": round(now - started, 1), "exit_code": code,
                          "engines": [_verdict_json(v, now) for v in verdicts]}, indent=2))
    else:
        for v in verdicts:
            print(f"engine {v.engine}: {v.state.value.upper()}: {v.reason}")
    return code


def _honest(v: Verdict, progress_seen: bool, watched: float) -> Verdict:
    """A short look at a busy engine that showed no progress must not be reported as healthy."""
    if v.state == State.WORKING and not progress_seen:
        return Verdict(v.engine, State.SUSPECT, f"{v.reason}; no progress seen in the {watched:.0f}s watched: "
                       "watch longer (--seconds 60) to tell a long step from a freeze",
                       v.since, v.t, v.stalled_for, v.incarnation, v.model, v.last_progress)
    return v


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    return Daemon(cfg, Path(cfg.state.dir)).run(once=args.once)


def cmd_record(args: argparse.Namespace) -> int:
    cfg = _config(args)
    out = Path(args.out)
    writer = TraceWriter(out, 0, {"url": cfg.engine.url, "recorded_at": iso(time.time())})
    watcher = build_watcher(cfg, sinks=[writer.write])
    deadline = watcher.clock() + args.seconds
    count = 0
    try:
        while watcher.clock() < deadline:
            t0 = watcher.clock()
            for tr in watcher.tick():
                print(f"{iso(watcher.wall_of(tr.t))} engine {tr.engine}: {tr.to_state.value}: {tr.reason}",
                      file=sys.stderr)
            count += 1
            time.sleep(max(0.0, min(cfg.scrape.interval - (watcher.clock() - t0), deadline - watcher.clock())))
    except KeyboardInterrupt:
        pass
    finally:
        writer.close()
    print(f"recorded {count} scrapes to {out}", file=sys.stderr)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    cfg = load(args.config)
    for tr in replay(read_trace(args.trace), cfg.thresholds()):
        print(json.dumps({"t": round(tr.t, 3), "engine": tr.engine,
                          "from": tr.from_state.value if tr.from_state else None,
                          "to": tr.to_state.value, "reason": tr.reason}))
    return 0


class _Parser(argparse.ArgumentParser):
    """Bad arguments exit 64 (EX_USAGE), like a bad config; argparse's own default is 2, which `check` means down."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="watchdog", description="Notices when a vLLM engine stops producing tokens.")
    p.add_argument("--version", action="version", version=f"engine-watchdog {__version__}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, url: bool = True, state_dir: bool = False, as_json: bool = False) -> None:
        sp.add_argument("--config", help="TOML config file (optional; every key has a default)")
        if url:
            sp.add_argument("--url", help="the vLLM server's base URL, e.g. http://127.0.0.1:8000")
        if state_dir:
            sp.add_argument("--state-dir", help="the service's state directory (default from config)")
        if as_json:
            sp.add_argument("--json", action="store_true", help="machine-readable output")

    c = sub.add_parser("check", help="watch for a few seconds and print one verdict per engine")
    common(c, as_json=True)
    c.add_argument("--seconds", type=float, default=10.0, help="longest time to watch (default 10)")
    c.set_defaults(func=cmd_check)

    r = sub.add_parser("run", help="watch continuously (the service)")
    common(r, state_dir=True)
    r.add_argument("--metrics-port", type=int, help="port for the watchdog's own metrics (0: off)")
    r.add_argument("--once", action="store_true", help="one pass, then exit")
    r.add_argument("--dry-run", action="store_true", help="everything except acting: restarts are only described")
    r.set_defaults(func=cmd_run)

    rec = sub.add_parser("record", help="record what the judgement sees, for replay")
    common(rec)
    rec.add_argument("--seconds", type=float, required=True)
    rec.add_argument("--out", required=True, help="trace file to write (JSON lines)")
    rec.set_defaults(func=cmd_record)

    d = sub.add_parser("dump", help="capture every engine process's stacks now, write a bundle, print the triage")
    common(d, as_json=True)
    d.add_argument("--out", help="directory for the bundle (default STATE_DIR/incidents)")
    d.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too)")
    d.set_defaults(func=lambda a: triage.cmd_dump(_config(a), a))

    ex = sub.add_parser("explain", help="classify stack dumps taken by hand (py-spy text/JSON, --native, faulthandler)")
    ex.add_argument("files", nargs="+")
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(func=triage.cmd_explain)

    inc = sub.add_parser("incidents", help="list incident bundles")
    common(inc, url=False, state_dir=True, as_json=True)
    inc.set_defaults(func=lambda a: triage.cmd_incidents(_config(a), a))

    sh = sub.add_parser("show", help="print one incident's summary")
    sh.add_argument("id")
    common(sh, url=False, state_dir=True)
    sh.set_defaults(func=lambda a: triage.cmd_show(_config(a), a))

    rep = sub.add_parser("report", help="tally verdicts across all incident bundles")
    common(rep, url=False, state_dir=True, as_json=True)
    rep.set_defaults(func=lambda a: triage.cmd_report(_config(a), a))

    operate.add_commands(sub, common, _config)

    rp = sub.add_parser("replay", help="run the judgement over a recorded trace; print transitions as JSON lines")
    rp.add_argument("trace")
    common(rp, url=False)
    rp.set_defaults(func=cmd_replay)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level)
    clash = clashing_distribution()
    if clash:
        log.warning("the unrelated package %s (filesystem events) is installed in this environment and shares the "
                    "import name 'watchdog'; install engine-watchdog into its own virtual environment", clash)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"watchdog: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TraceError as e:
        print(f"watchdog: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # e.g. a state directory that cannot be created or written
        print(f"watchdog: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_IOERR
    except Exception:  # a bug, never "bad config": say so with the traceback (journal under systemd)
        log.exception("watchdog %s: unexpected error (a bug; please report it with this traceback)", __version__)
        return EXIT_SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
