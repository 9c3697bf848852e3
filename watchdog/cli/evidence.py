"""Commands for evidence: `dump`, `explain`, `incidents`, `show`, `report`."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from watchdog.config.load import Config
from watchdog.core.types import incident_id
from watchdog.evidence.bundle.investigate import Investigator
from watchdog.evidence.bundle.per_node import node_lines, per_node
from watchdog.evidence.bundle.write import BundleError, list_bundles
from watchdog.evidence.explain.ranks import ProcessExplanation, classify, cross_rank, poll_parking
from watchdog.evidence.gpu.nvml import GpuMonitor, NvmlSource
from watchdog.evidence.stacks.parse import Frame, StackParseError, parse_any
from watchdog.nodes.remote import RemoteEvidence
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.scrape.fetch import MetricsFetcher

EXIT_COMPLETE, EXIT_INCOMPLETE, EXIT_NOTHING = 0, 1, 2


def _frames_text(frames: tuple[Frame, ...] | list[dict[str, Any]], n: int = 4) -> str:
    parts = [(f.function, f.file) if isinstance(f, Frame) else (f["function"], f["file"]) for f in frames[:n]]
    return " < ".join(f"{fn} ({file.rsplit('/', 1)[-1]})" for fn, file in parts) or "-"


def work_pending(http: EngineHTTP) -> bool | None:
    """Whether the page shows work pending right now (None: the page cannot be read)."""
    scrape = MetricsFetcher(http).scrape()
    if scrape.page is None or not scrape.page.engines:
        return None
    return any((e.running or 0) > 0 or (e.waiting or 0) > 0 for e in scrape.page.engines.values())


def cmd_dump(cfg: Config, args: argparse.Namespace) -> int:
    cfg = cfg.with_overrides(capture={"native": True if args.native else None})
    http = EngineHTTP(cfg.engine.url, cfg.scrape.limits(), cfg.api_key().reveal())
    g = cfg.gpu
    gpu: GpuMonitor | None = GpuMonitor(NvmlSource(), g.dense_interval, g.dense_interval) if g.enabled else None
    if gpu is not None and gpu.start():
        gpu = None  # no GPU here: nothing to add
    remote = RemoteEvidence(cfg) if cfg.nodes else None  # ssh masters and temp dirs: closed below
    inv = Investigator(cfg, http, gpu=gpu, others=remote)
    try:
        evidence = inv.investigate(work_pending=work_pending(http))  # the GPU is sampled meanwhile
        out = Path(args.out) if args.out else inv.incidents_dir
        wall = time.time()
        incident = incident_id(wall, cfg.engine.name, "all", "manual", secrets.token_hex(2))
        try:
            path = inv.write(incident, "all", "manual", "watchdog dump on demand", evidence, out)
        except BundleError as err:
            print(f"watchdog: {err}", file=sys.stderr)
            path = None
    finally:
        if gpu is not None:
            gpu.stop()
        if remote is not None:
            remote.close()
    f = evidence.findings
    m = json.loads((path / "manifest.json").read_text()) if path else {}
    # per node, what was captured (the bundle's, with logs and versions; else the capture's own)
    m.setdefault("nodes", per_node(evidence.capture, {}, f.problems))
    # complete: every rank's stacks read, and on every node ([[nodes]]): a node that could not be reached is missing
    complete = f.complete and all(n["evidence"] != "missing" for k, n in m["nodes"].items() if k != "local")
    if args.json:
        print(json.dumps({"bundle": str(path) if path else None, "complete": complete, **m}, indent=2))
    else:
        for p in f.processes:
            e = p.explanation
            rank = ",".join(f"{k}{v}" for k, v in p.process.ranks.items()) or "-"
            what = f"{e.cls.value}: {_frames_text(e.frames)}" if e else f"NO STACK: {p.error}"
            print(f"{p.process.label:24} pid {p.process.pid:<7} {p.process.role:12} rank {rank:8} state {p.state}  "
                  f"{what}")
        if len(m["nodes"]) > 1:  # [[nodes]]: which node's evidence is here, which is missing
            for line in node_lines(m["nodes"]):
                print(line)
        print(f"culprit: {f.cross_rank.culprit or 'none named'}: {f.cross_rank.reason}")
        print(f"poll-parking: {f.hypothesis.status.value}: {f.hypothesis.reason}")
        for problem in f.problems:
            print(f"problem: {problem}")
        print(f"bundle: {path}" if path else "bundle: NOT WRITTEN")
    if not f.processes:
        return EXIT_NOTHING
    return EXIT_COMPLETE if complete and path is not None else EXIT_INCOMPLETE


def _explanation_json(e: ProcessExplanation) -> dict[str, Any]:
    return {"name": e.name, "pid": e.pid, "role": e.role, "rank": e.rank, "class": e.cls.value, "thread": e.thread,
            "why": e.why, "spec_decode": e.spec_decode,
            "frames": [{"function": f.function, "file": f.file, "line": f.line} for f in e.frames]}


def cmd_explain(args: argparse.Namespace) -> int:
    expls: list[ProcessExplanation] = []
    for name in args.files:
        try:
            data = Path(name).read_bytes()
            stacks = parse_any(data)
        except OSError as err:
            print(f"watchdog: {name}: {err.strerror}", file=sys.stderr)
            return 64
        except StackParseError as err:
            print(f"watchdog: {name}: {err}", file=sys.stderr)
            return 64
        if not stacks:
            print(f"watchdog: {name}: no stack dump recognised (py-spy text or JSON, --native, faulthandler)",
                  file=sys.stderr)
            return 64
        expls += [classify(ps) for ps in stacks]
    cross = cross_rank(expls) if len(expls) > 1 else None
    hyp = poll_parking(expls, None, None) if len(expls) > 1 else None
    if args.json:
        out: dict[str, Any] = {"processes": [_explanation_json(e) for e in expls]}
        if cross and hyp:
            out["cross_rank"] = {"culprit": cross.culprit, "reason": cross.reason}
            out["poll_parking"] = {"status": hyp.status.value, "reason": hyp.reason}
        print(json.dumps(out, indent=2))
        return 0
    for e in expls:
        print(f"{e.name:24} {e.role or '?':10} {e.cls.value:26} {_frames_text(e.frames)}")
        print(f"    {e.why}")
    if cross and hyp:
        print(f"culprit: {cross.culprit or 'none named'}: {cross.reason}")
        print(f"poll-parking: {hyp.status.value}: {hyp.reason}")
    return 0


def cmd_incidents(cfg: Config, args: argparse.Namespace) -> int:
    bundles = list_bundles(Path(cfg.state.dir) / "incidents")
    if args.json:
        print(json.dumps([{k: m[k] for k in ("id", "created", "engine", "state", "decision", "culprit", "path")}
                          | {"poll_parking": m["poll_parking"]["status"]} for m in bundles], indent=2))
        return 0
    if not bundles:
        print("no incidents")
    for m in bundles:
        print(f"{m['id']:48} {m['state']:8} {m['decision']:10} culprit={m['culprit'] or '-':16} "
              f"poll-parking={m['poll_parking']['status']}")
    return 0


def cmd_show(cfg: Config, args: argparse.Namespace) -> int:
    for m in list_bundles(Path(cfg.state.dir) / "incidents"):
        if m["id"] == args.id or m["id"].startswith(args.id):
            print((Path(m["path"]) / "summary.md").read_text(), end="")
            return 0
    print(f"watchdog: no incident {args.id!r}", file=sys.stderr)
    return EXIT_NOTHING


def cmd_report(cfg: Config, args: argparse.Namespace) -> int:
    bundles = list_bundles(Path(cfg.state.dir) / "incidents")
    hyp = Counter(m["poll_parking"]["status"] for m in bundles)
    culprits: Counter[str] = Counter()
    for m in bundles:
        role = next((p["role"] for p in m["processes"] if p["title"] and p["title"].endswith(m["culprit"] or "\0")),
                    None)
        culprits[role or ("none" if not m["culprit"] else m["culprit"])] += 1
    out = {"incidents": len(bundles), "poll_parking": dict(hyp), "culprits_by_role": dict(culprits),
           "decisions": dict(Counter(m["decision"] for m in bundles))}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{len(bundles)} incidents")
    for key in ("SUPPORTED", "CONTRADICTED", "INCONCLUSIVE", "NOT_APPLICABLE"):
        print(f"  poll-parking {key:15} {hyp.get(key, 0)}")
    for role, n in culprits.most_common():
        print(f"  culprit {role:20} {n}")
    return 0
