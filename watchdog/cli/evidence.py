"""Commands for evidence: `dump`, `explain`, `incidents`, `show`, `report`."""

from __future__ import annotations

import argparse
import json
import re
import secrets
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from watchdog import __version__
from watchdog.cli.progress import Progress
from watchdog.config.load import Config
from watchdog.core.runbooks import Runbook, runbook_link
from watchdog.core.types import PageReading, incident_id
from watchdog.evidence.bundle.investigate import Investigator
from watchdog.evidence.bundle.per_node import node_lines, per_node
from watchdog.evidence.bundle.upstream import BundleFiles, Redaction, render
from watchdog.evidence.bundle.write import PARTIAL, BundleError, list_bundles
from watchdog.evidence.explain import known_hangs
from watchdog.evidence.explain.ranks import ProcessExplanation, classify, cross_rank, poll_parking
from watchdog.evidence.gpu.nvml import GpuMonitor, NvmlSource
from watchdog.evidence.stacks.parse import Frame, StackParseError, parse_any
from watchdog.nodes.remote import RemoteEvidence
from watchdog.nodes.transport import close_links, open_links
from watchdog.scrape.engine_http import EngineHTTP
from watchdog.scrape.fetch import MetricsFetcher
from watchdog.service.events import generations

EXIT_COMPLETE, EXIT_INCOMPLETE, EXIT_NOTHING = 0, 1, 2


def _frames_text(frames: tuple[Frame, ...] | list[dict[str, Any]], n: int = 4) -> str:
    parts = [(f.function, f.file) if isinstance(f, Frame) else (f["function"], f["file"]) for f in frames[:n]]
    return " < ".join(f"{fn} ({file.rsplit('/', 1)[-1]})" for fn, file in parts) or "-"


def page_now(http: EngineHTTP) -> PageReading | None:
    """The page as the scrape reads it (None: it cannot be read)."""
    return MetricsFetcher(http).scrape().page


def work_pending(page: PageReading | None) -> bool | None:
    """Whether the page shows work pending (None: the page could not be read)."""
    if page is None or not page.engines:
        return None
    return any((e.running or 0) > 0 or (e.waiting or 0) > 0 for e in page.engines.values())


def cmd_dump(cfg: Config, args: argparse.Namespace) -> int:
    cfg = cfg.with_overrides(capture={"native": True if args.native else None})
    http = EngineHTTP(cfg.engine.url, cfg.scrape.limits(), cfg.api_key().reveal())
    g = cfg.gpu
    gpu: GpuMonitor | None = GpuMonitor(NvmlSource(), g.dense_interval, g.dense_interval) if g.enabled else None
    if gpu is not None and gpu.start():
        gpu = None  # no GPU here: nothing to add
    links = open_links(cfg.nodes)  # ssh masters and temp dirs: closed below
    remote = RemoteEvidence(cfg, links) if cfg.nodes else None
    said, c = Progress("dump"), cfg.capture
    try:
        said.say(f"reading the page at {cfg.engine.url}: is work pending?")
        page = page_now(http)
        pending = work_pending(page)
        inv = Investigator(cfg, http, gpu=gpu, others=remote, reading=lambda: page)  # the assessment reads it too
        said.say(f"finding the engine's processes, then py-spy: {c.rounds} rounds {c.gap:g}s apart"
                 + (f", here and on {', '.join(n.name for n in cfg.nodes)} over ssh" if cfg.nodes else ""))
        evidence = inv.investigate(work_pending=pending)  # the GPU is sampled meanwhile
        said.say(f"stacks of {len(evidence.findings.processes)} processes in {evidence.seconds:.1f}s; writing the "
                 "bundle (the page, log tail, versions)")
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
        close_links(links)
    f = evidence.findings
    m = json.loads((path / "manifest.json").read_text()) if path else {}
    # per node, what was captured (the bundle's, with logs and versions; else the capture's own)
    m.setdefault("nodes", per_node(evidence.capture, {}, evidence.capture.problems))
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
        if m.get("headline"):  # what happened, from the cause down, and its runbook (the bundle's)
            print(f"headline: {m['headline']}\nrunbook: {m['runbook_link']}")
        print(f"culprit: {f.cross_rank.culprit or 'none named'}: {f.cross_rank.reason}")
        print(f"poll-parking: {f.hypothesis.status.value}: {f.hypothesis.reason}")
        print(f"known vLLM hang: {known_hangs.said(m.get('known_hang'))}")
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
    """One bundle's summary: by id, id prefix, or its directory (a bundle copied off the host, `dump --out`)."""
    if getattr(args, "upstream", False):
        return show_upstream(cfg, args)
    bundle, why = _find_bundle(Path(cfg.state.dir) / "incidents", args.id)
    if bundle is None:
        print(f"watchdog: {why}", file=sys.stderr)
        return EXIT_NOTHING
    try:
        m = json.loads(_read(bundle / "manifest.json"))
        summary = _read(bundle / "summary.md")
    except (OSError, ValueError) as e:
        print(f"watchdog: {bundle}: not a readable bundle ({getattr(e, 'strerror', None) or e})", file=sys.stderr)
        return EXIT_INCOMPLETE
    if why:
        print(f"watchdog: {bundle.name}: {why}", file=sys.stderr)
    code = EXIT_INCOMPLETE if why else EXIT_COMPLETE
    if getattr(args, "json", False):
        print(json.dumps({"id": bundle.name.removeprefix(PARTIAL), "bundle": str(bundle), "complete": not why,
                          "manifest": m, "summary": summary}, indent=2))
        return code
    if isinstance(m, dict) and not m.get("headline"):  # written before bundles had headlines: the reason, plainly
        print(f"**{m.get('decision_reason') or m.get('reason') or 'no reason recorded'}**\n\n"
              f"Runbook: {runbook_link(Runbook.FROZEN, cfg.alerts.runbook_base)}\n")
    print(summary, end="")
    return code


def cmd_report(cfg: Config, args: argparse.Namespace) -> int:
    bundles = list_bundles(Path(cfg.state.dir) / "incidents")
    hyp = Counter(m["poll_parking"]["status"] for m in bundles)
    culprits: Counter[str] = Counter()
    for m in bundles:
        role = next((p["role"] for p in m["processes"] if p["title"] and p["title"].endswith(m["culprit"] or "\0")),
                    None)
        culprits[role or ("none" if not m["culprit"] else m["culprit"])] += 1
    hangs = Counter(f"{k['id']}/{k['status']}" if isinstance(k := m.get("known_hang"), dict) else "none"
                    for m in bundles)  # lost_wakeup/affected, lost_wakeup/fixed (the engine has the fix: not it)
    out = {"incidents": len(bundles), "poll_parking": dict(hyp), "culprits_by_role": dict(culprits),
           "decisions": dict(Counter(m["decision"] for m in bundles)),
           "known_hangs": dict(hangs)}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{len(bundles)} incidents")
    for key in ("SUPPORTED", "CONTRADICTED", "INCONCLUSIVE", "NOT_APPLICABLE"):
        print(f"  poll-parking {key:15} {hyp.get(key, 0)}")
    for role, n in culprits.most_common():
        print(f"  culprit {role:20} {n}")
    for hang, n in hangs.most_common():  # a known vLLM hang the evidence matched ("none")
        print(f"  known hang {hang:17} {n}")
    return 0


# -- `watchdog show ID --upstream`: the files of one bundle (and its state directory) for upstream.render --------

READ_CAP = 8 * 1024 * 1024  # the most read of one bundle file: a bundle is ours, but may have been copied in
_DUMP = re.compile(r"round(\d+)-(\d+)-(.*)\.json$")


def _find_bundle(root: Path, wanted: str) -> tuple[Path | None, str]:
    """A bundle directory by id, id prefix or path; (None, why) when there is none. A partial one (a crash while it
    was written) is taken only when no complete one matches, and said so."""
    given = Path(wanted)
    if given.is_dir() and ((given / "manifest.json").exists() or (given / "dumps").is_dir()):
        return given, ""
    names = sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    for complete in (True, False):
        for name in names:
            bare = name.removeprefix(PARTIAL)
            if (name == bare) == complete and (bare == wanted or bare.startswith(wanted)):
                return root / name, "" if complete else "this bundle was never completed (the watchdog stopped " \
                    "while writing it): only what it holds so far"
    return None, f"no incident {wanted!r} under {root}"


def _read(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(READ_CAP).decode("utf-8", "replace")


def _jsonl(paths: list[Path], keep: str = "") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if keep and keep not in line:
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict):
                        out.append(rec)
        except OSError:
            continue
    return out


def read_bundle(bundle: Path, state_dir: Path, cfg: Config) -> BundleFiles:
    """Everything `upstream.render` reads: the manifest, the last round's dumps, the page, the events and the page
    trace of the state directory. What cannot be read is said (``unread``), never raised."""
    unread: list[str] = []
    manifest: dict[str, Any] | None = None
    try:
        raw = json.loads(_read(bundle / "manifest.json"))
        manifest = raw if isinstance(raw, dict) else None
        if manifest is None:
            unread.append("manifest.json is not a JSON object")
    except OSError as e:
        unread.append(f"manifest.json cannot be read ({e.strerror or e})")
    except ValueError as e:
        unread.append(f"manifest.json is not valid JSON ({e})")
    # one process's dumps by (pid, title): another node's title ends "on node X", and pids of two nodes collide
    latest: dict[tuple[int, str], tuple[int, Path, str]] = {}
    for path in sorted((bundle / "dumps").glob("round*.json")) if (bundle / "dumps").is_dir() else []:
        if m := _DUMP.match(path.name):
            rnd, pid, title = int(m.group(1)), int(m.group(2)), m.group(3)
            if (pid, title) not in latest or latest[pid, title][0] < rnd:
                latest[pid, title] = (rnd, path, re.sub(r"^(VLLM|sglang|ray)-", r"\1::", title))
    dumps = []
    for (pid, _), (_, path, title) in sorted(latest.items()):
        try:
            dumps.append((pid, "" if title == "process" else title, _read(path)))
        except OSError as e:
            unread.append(f"dumps/{path.name} cannot be read ({e.strerror or e})")
    if not latest:
        unread.append("the bundle holds no stack dumps (dumps/ is missing or empty)")
    page = ""
    if (bundle / "metrics.txt").is_file():
        try:
            page = _read(bundle / "metrics.txt")
        except OSError as e:
            unread.append(f"metrics.txt cannot be read ({e.strerror or e})")
    events = _jsonl(list(generations(state_dir / "events.jsonl")))
    scrapes = _jsonl([state_dir / "trace.jsonl.1", state_dir / "trace.jsonl"], keep='"scrape"')
    return BundleFiles(bundle.name.removeprefix(PARTIAL), manifest, tuple(unread), tuple(dumps), page,
                       tuple(events), tuple(r for r in scrapes if r.get("kind") == "scrape"),
                       cfg.judge.suspect_after)


def _hosts(cfg: Config) -> tuple[str, ...]:
    """Host names to take out of a report besides IP literals and URL hosts: the engine's, the nodes', ours. A name
    that is also a [[nodes]] name is the operator's label and stays."""
    labels = {n.name for n in cfg.nodes}
    names = [urlsplit(cfg.engine.url).hostname or "", socket.gethostname(), *(n.host for n in cfg.nodes)]
    return tuple(h for h in names if h and h not in labels and ("." in h or "-" in h or len(h) >= 6
                                                                 or any(c.isdigit() for c in h)))


def show_upstream(cfg: Config, args: argparse.Namespace) -> int:
    state_dir = Path(cfg.state.dir)
    bundle, why = _find_bundle(state_dir / "incidents", args.id)
    if bundle is None:
        print(f"watchdog: {why}", file=sys.stderr)
        return EXIT_NOTHING
    if bundle.parent.name == "incidents" and bundle.parent.parent != state_dir:
        state_dir = bundle.parent.parent  # a bundle given by path: its own state directory's events
    files = read_bundle(bundle, state_dir, cfg)
    if why:
        files = BundleFiles(files.id, files.manifest, (why, *files.unread), files.dumps, files.metrics_page,
                            files.events, files.scrapes, files.suspect_after)
    print(render(files, Redaction(_hosts(cfg), args.keep_addresses), __version__), end="")
    for line in files.unread:
        print(f"watchdog: {bundle.name}: {line}", file=sys.stderr)
    return EXIT_COMPLETE if files.manifest is not None and files.dumps and not why else EXIT_INCOMPLETE
