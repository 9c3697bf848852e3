"""The watch's own verbs: ``check`` (a verdict now), ``run`` (the service), ``record`` and ``replay`` (traces)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchdog.cli.config import load_config
from watchdog.cli.progress import Progress
from watchdog.config.load import Config
from watchdog.core.types import State, Verdict, iso
from watchdog.evidence.collect.deadline_read import read_deadlines
from watchdog.evidence.gpu.nvml import gpu_availability
from watchdog.judge.judge import worst
from watchdog.service.daemon import Daemon
from watchdog.service.replay import replay
from watchdog.service.trace import TraceWriter, read_trace
from watchdog.service.watcher import build_watcher

EXIT_OK, EXIT_FROZEN, EXIT_DOWN, EXIT_UNKNOWN = 0, 1, 2, 3
_EXIT_BY_STATE = {State.IDLE: EXIT_OK, State.WORKING: EXIT_OK, State.FROZEN: EXIT_FROZEN, State.DOWN: EXIT_DOWN}
_SETTLED = {State.IDLE, State.DOWN, State.BLIND}


def _verdict_json(v: Verdict, now: float) -> dict[str, Any]:
    return {
        "engine": v.engine, "state": v.state.value, "reason": v.reason, "model": v.model,
        "for_seconds": round(now - v.since, 1), "stalled_seconds": round(v.stalled_for, 1),
        "seconds_since_progress": None if v.last_progress is None else round(now - v.last_progress, 1),
        "incarnation": v.incarnation,
    }


def cmd_check(cfg: Config, args: argparse.Namespace) -> int:
    watcher = build_watcher(cfg)
    started = watcher.clock()
    deadline = started + args.seconds
    progress_seen: set[str] = set()
    said = Progress("check")
    said.say(f"watching {cfg.engine.url} for up to {args.seconds:g}s, until every verdict settles")
    shown, shown_at = "", started
    while True:
        t0 = watcher.clock()
        watcher.tick()
        verdicts = watcher.judge.verdicts()
        progress_seen |= {v.engine for v in verdicts if v.last_progress is not None and v.last_progress > started}
        settled = all(v.state in _SETTLED or (v.state == State.WORKING and v.engine in progress_seen)
                      for v in verdicts)
        probing = watcher.prober is not None and watcher.prober.in_flight
        now_seen = ", ".join(f"engine {v.engine} {v.state.value}" for v in verdicts) or "no engine seen yet"
        now_seen += "; a probe generation is out" if probing else ""
        if now_seen != shown or watcher.clock() - shown_at >= 5.0:  # what changed, else a line every 5 s
            said.say(now_seen if now_seen != shown else f"still watching: {now_seen}")
            shown, shown_at = now_seen, watcher.clock()
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
                          "engines": [_verdict_json(v, now) for v in verdicts],
                          "deadlines": read_deadlines(cfg, cfg.engine.url).as_dict(),
                          "gpu": gpu_availability() if cfg.gpu.enabled else {"available": False, "gpus": 0,
                                                                             "why": "gpu.enabled is off"}},
                         indent=2))
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


def cmd_run(cfg: Config, args: argparse.Namespace) -> int:
    return Daemon(cfg, Path(cfg.state.dir)).run(once=args.once)


def cmd_record(cfg: Config, args: argparse.Namespace) -> int:
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
    cfg = load_config(args.config)
    for tr in replay(read_trace(args.trace), cfg.thresholds()):
        print(json.dumps({"t": round(tr.t, 3), "engine": tr.engine,
                          "from": tr.from_state.value if tr.from_state else None,
                          "to": tr.to_state.value, "reason": tr.reason}))
    return 0


def _seconds(text: str) -> float:
    """``--seconds``: a number of seconds above 0 (nan and inf would watch for ever)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:40]!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0 and finite, got {text[:40]!r}")
    return seconds


def add_commands(sub: Any, common: Callable[..., None], config_of: Callable[[argparse.Namespace], Config]) -> None:
    c = sub.add_parser("check", help="watch for a few seconds and print one verdict per engine")
    common(c, as_json=True)
    c.add_argument("--seconds", type=_seconds, default=10.0, help="longest time to watch (default 10)")
    c.set_defaults(func=lambda a: cmd_check(config_of(a), a))

    r = sub.add_parser("run", help="watch continuously (the service)")
    common(r, state_dir=True)
    r.add_argument("--metrics-port", type=int, help="port for the watchdog's own metrics (0: off)")
    r.add_argument("--once", action="store_true", help="one pass, then exit")
    r.add_argument("--dry-run", action="store_true", help="everything except acting: restarts are only described")
    r.set_defaults(func=lambda a: cmd_run(config_of(a), a))

    rec = sub.add_parser("record", help="record what the judgement sees, for replay")
    common(rec)
    rec.add_argument("--seconds", type=_seconds, required=True)
    rec.add_argument("--out", required=True, help="trace file to write (JSON lines)")
    rec.set_defaults(func=lambda a: cmd_record(config_of(a), a))

    rp = sub.add_parser("replay", help="run the judgement over a recorded trace; print transitions as JSON lines")
    rp.add_argument("trace")
    common(rp, url=False)
    rp.set_defaults(func=cmd_replay)
