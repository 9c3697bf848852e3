"""Incident bundles: one directory per incident, with a versioned manifest, a 30-second summary and the raw captures.

A bundle is built in ``incidents/.partial-<id>/`` and renamed into place only when every file is written and
synced, so a crash mid-write never leaves a bundle that looks complete. Directories are mode 0700 (stacks can
hold paths and names worth keeping private). Retention keeps at most ``max_count`` bundles and ``max_bytes``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from watchdog.core.processes import LOCAL, Capture
from watchdog.core.runbooks import runbook_link
from watchdog.evidence.bundle.per_node import node_lines, per_node
from watchdog.evidence.collect.context import Context
from watchdog.evidence.explain import known_hangs
from watchdog.evidence.explain.findings import Findings, ProcessFinding
from watchdog.evidence.explain.headline import GpuSaid, Headline, compose
from watchdog.evidence.explain.log_cause import cause_of, down_headline
from watchdog.evidence.explain.ring_said import ring_to_dict, said_all
from watchdog.evidence.gpu.culprit import GpuCulprit, RankView, gpu_culprit
from watchdog.evidence.gpu.gather import GpuEvidence, write_gpu_files
from watchdog.evidence.gpu.readings import corroborate, gpu_of
from watchdog.evidence.stacks.parse import Frame

MANIFEST_VERSION = 1
PARTIAL = ".partial-"


class BundleError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class BundleHeader:
    """What a bundle says of the incident it belongs to. ``id`` is the incident's one id
    (`watchdog.core.types.incident_id`): the bundle's directory name, and the id in every event, alert and
    ``watchdog status``."""

    id: str
    engine: str
    state: str  # the verdict that triggered it (frozen, or "manual" for `watchdog dump`)
    reason: str
    url: str
    created: float  # wall time


def _frames(frames: tuple[Frame, ...]) -> list[dict[str, Any]]:
    return [{"function": f.function, "file": f.file, "line": f.line, "native": f.native} for f in frames]


def _process_record(f: ProcessFinding, capture: Capture) -> dict[str, Any]:
    p, e = f.process, f.explanation
    dumps = capture.dumps_of(p)
    return {
        "pid": p.pid, "node": p.node,  # its pid on its own node
        "role": p.role, "title": p.title, "ranks": p.ranks, "state": f.state,
        "class": e.cls.value if e else None, "thread": e.thread if e else None, "why": e.why if e else f.error,
        "frames": _frames(e.frames) if e else [], "spec_decode": e.spec_decode if e else False,
        "moved": f.moved, "cpu_seconds_between_captures": f.cpu_seconds,
        "cpu_in_quiet_pauses": list(f.quiet) if f.quiet else None,  # [CPU s, s] with no py-spy attached
        "wchan": dumps[0].facts.wchan if dumps and dumps[0].facts else None,
        "threads": dumps[0].facts.threads if dumps and dumps[0].facts else None,
        "nonblocking": any(d.nonblocking for d in dumps), "error": f.error or None,
        "failures": sorted({d.failure.value for d in dumps if d.failure is not None}),
        "native": None if f.native is None else {"class": f.native.cls.value, "why": f.native.why,
                                                 "frames": _frames(f.native.frames)},
    }


def _failures(capture: Capture) -> list[dict[str, Any]]:
    """Every dump that failed (or lost its native frames): its kind (`Failure`) and its fix."""
    titles = {p.id: p.title for p in capture.processes}
    return [{"round": i, "node": key.node, "pid": key.pid, "title": titles.get(key, ""), "kind": d.failure.value,
             "error": d.error}
            for i, rnd in enumerate(capture.rounds, 1) for key, d in sorted(rnd.items()) if d.failure is not None]


def _node_of(findings: Findings, name: str | None) -> str | None:
    """The node of the process an explanation names ("local": this host)."""
    return next((f.process.node for f in findings.processes if f.explanation and f.explanation.name == name), None)


def manifest(inc: BundleHeader, capture: Capture, findings: Findings, context: Context,
             files: list[str], said: Headline | None = None, runbook_base: str = "") -> dict[str, Any]:
    logs = _logs(context)
    hangs = known_hangs.match(findings, capture, logs, context.versions.get("vllm", ""))  # ends the headline
    cause = cause_of(logs) if inc.state == "down" else None  # a down engine is said by its log's error
    if inc.state == "down":
        said = Headline(*down_headline(inc.reason, cause, bool(context.log_source)))
    said = said or headline_of(inc, capture, findings, None)
    return {
        "version": MANIFEST_VERSION,
        "id": inc.id, "created": datetime.fromtimestamp(inc.created, UTC).isoformat(), "engine": inc.engine,
        "state": inc.state, "reason": inc.reason, "url": inc.url,
        # what happened, from the cause down, and the runbook of that cause (watchdog.evidence.explain.headline)
        "headline": known_hangs.with_clause(said.text, hangs), "runbook": said.runbook.value,
        "runbook_link": runbook_link(said.runbook, runbook_base),
        "capture_complete": findings.complete, "capture_failures": _failures(capture),
        "decision": findings.decision.value, "decision_reason": findings.reason,
        "stuck_kind": findings.stuck_kind.value if findings.stuck_kind else None,
        "culprit": findings.cross_rank.culprit, "culprit_node": _node_of(findings, findings.cross_rank.culprit),
        "cross_rank": findings.cross_rank.reason,
        "cross_rank_frames": _frames(findings.cross_rank.frames),
        # a known vLLM hang this evidence shows, with its sources and the release that fixed it (None: no match)
        "known_hang": known_hangs.manifest_entry(hangs),
        "known_hang_said": hangs[0].clause if hangs else known_hangs.NO_MATCH,
        "ring": said_all(capture.rings),  # the broadcast ring's flags in words (ring.json: every block)
        "poll_parking": {"status": findings.hypothesis.status.value, "reason": findings.hypothesis.reason,
                         "frames": _frames(findings.hypothesis.frames),
                         "spec_decode_frames": _frames(findings.hypothesis.spec_frames)},
        "processes": [_process_record(f, capture) for f in findings.processes],
        "problems": sorted({*findings.problems, *map(str, context.problems)}),
        "ring_buffer_warnings_in_log": context.ring_warnings, "log_source": context.log_source,
        # down: the error that ended the engine's last life, as its log has it (evidence/explain/log_cause.py)
        "log_cause": cause.to_json() if cause is not None else None,
        "versions": context.versions, "capture_options": capture.options, "files": files,
        "nodes": per_node(capture, context.nodes, [*capture.problems, *context.problems], context.log_source,
                          context.log_tail),
    }


def _kinds(failures: list[dict[str, Any]]) -> str:
    """" (denied: 2 dumps, timeout: 1 dump)": the failure kinds at a glance; the texts with fixes are under problems."""
    counts: dict[str, int] = {}
    for f in failures:
        counts[f["kind"]] = counts.get(f["kind"], 0) + 1
    return (" (" + ", ".join(f"{k}: {n} dump{'s' if n > 1 else ''}" for k, n in sorted(counts.items())) + ")"
            if counts else "")


def _stacks_lines(m: dict[str, Any]) -> list[str]:
    """What the stacks said, and the head of their table."""
    return [
        f"- stacks say: **{m['decision']}**: {m['decision_reason']}",
        f"- culprit: **{m['culprit'] or 'none named'}**"
        + (f" on node {m['culprit_node']}" if m.get("culprit_node") not in (None, "local") else "")
        + f": {m['cross_rank']}",
        f"- poll-parking hypothesis: **{m['poll_parking']['status']}**: {m['poll_parking']['reason']}",
        f"- known vLLM hang: {known_hangs.said(m.get('known_hang'))}",
        *([f"- broadcast ring: {m['ring']}"] if m.get("ring") else []),
        f"- capture complete: {'yes' if m['capture_complete'] else 'NO'}" + _kinds(m.get("capture_failures", []))
        + (f"; shared-memory ring warnings in the log: {m['ring_buffer_warnings_in_log']}" if m["log_source"] else ""),
        *([f"- {line}" for line in node_lines(m["nodes"])] if len(m.get("nodes") or {}) > 1 else []),
        "",
        "| process | pid | state | class | moved | CPU s | deciding frames |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]


def summary(m: dict[str, Any]) -> str:
    lines = [
        f"# Incident {m['id']}",
        "",
        *([f"**{m['headline']}**", "", f"Runbook: {m['runbook_link']}", ""] if m.get("headline") else []),
        f"**engine {m['engine']}: {m['state'].upper()}** at {m['created']} on {m['url']}",
        f"- why: {m['reason']}",
        *([f"- the engine log says: `{c['exception'] + ': ' if c['exception'] else ''}{c['error']}` "
           f"({c['process'] or 'no process named'}, line {c['line']} of `log-tail.txt`)"]
          if (c := m.get("log_cause")) else []),
    ]
    if m["state"] == "down" and not m["processes"]:  # a down engine with nothing left: no stacks to speak of
        lines.append("- left running: nothing (every engine process had exited: no stacks to take)")
    else:
        lines += _stacks_lines(m)
    for p in m["processes"]:
        frames = " < ".join(f"{f['function']} ({f['file'].rsplit('/', 1)[-1]})" for f in p["frames"][:3])
        lines.append(f"| {p['title'] or p['role']} | {p['pid']} | {p['state']} | {p['class'] or 'no stack'} | "
                     f"{'-' if p['moved'] is None else ('yes' if p['moved'] else 'no')} | "
                     f"{'-' if p['cpu_seconds_between_captures'] is None else p['cpu_seconds_between_captures']} | "
                     f"{frames or p['why']} |")
    if m.get("gpu"):
        g = m["gpu"]
        lines += ["", "## GPUs (power corroborates the stacks; it never decides alone)",
                  *([f"- culprit GPU rank: **{g.get('culprit') or 'none named'}**: {g.get('culprit_reason', '')}"]
                    if m["processes"] else []),  # a down engine with nothing left has no ranks to blame
                  *[f"- {line}" for line in g["ranks"]], *[f"- {line}" for line in g["lines"]]]
    if m["capture_options"].get("locals"):
        lines += ["", "**py-spy --locals was ON: these dumps may hold prompts and secrets. Share with care.**"]
    if m["problems"]:
        lines += ["", "## Capture problems (each with its fix)", *[f"- {p}" for p in m["problems"]]]
    held = [f"{what} in `{name}`" for name, what in (("dumps/", "raw py-spy dumps"), ("metrics.txt", "the metrics "
            "page"), ("log-tail.txt", "the engine log's tail")) if any(f.startswith(name) for f in m["files"])]
    lines += ["", f"Files: {'; '.join(held)}." if held else "No raw files: nothing could be read.", ""]
    return "\n".join(lines)


def gpu_views(gpu: GpuEvidence, findings: Findings) -> tuple[list[RankView], GpuCulprit]:
    """Each GPU rank's stack class with its GPU's state, and the culprit GPU rank they name (from stack classes,
    power, RAS and the Flight Recorder: `watchdog.evidence.gpu.culprit`)."""
    views = [RankView(f.explanation.name, f.process.ranks.get("TP"), (f.native or f.explanation).cls.value,
                      (f.native or f.explanation).frames,  # a GPU rank's waits are in its native frames
                      r.state if (r := gpu_of(gpu.readings, f.process)) else None)
             for f in findings.processes if f.explanation is not None and f.process.role == "worker"]
    return views, gpu_culprit(views, gpu.ras, gpu.fr)


def gpu_manifest(gpu: GpuEvidence, findings: Findings) -> dict[str, Any]:
    """The GPU part of the manifest: readings, and what each rank's GPU adds to its stack class."""
    ranks = []
    for f in findings.processes:
        reading = gpu_of(gpu.readings, f.process)
        e = f.native or f.explanation
        said = corroborate(e.cls.value if e else "", reading)
        if said:
            ranks.append(f"{f.process.label}: {said}")
    _, c = gpu_views(gpu, findings)
    return {"culprit": c.culprit, "culprit_reason": c.reason, "culprit_sources": list(c.sources),
            "readings": [r.to_json() for r in gpu.readings], "ranks": ranks, "lines": gpu.lines(),
            "ras": gpu.ras.verdict() if gpu.ras is not None else None, "flight_recorder": gpu.fr_verdict or None,
            "flight_recorder_seconds": round(gpu.fr_seconds, 2), "problems": list(gpu.problems)}


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _logs(context: Context) -> str:
    """Every node's log tail, this node's first."""
    return "\n".join([context.log_tail, *(n.log_tail for n in context.nodes.values())])


def headline_of(inc: BundleHeader, capture: Capture, findings: Findings, gpu: GpuEvidence | None) -> Headline:
    """The headline of a bundle's stacks: their cause, with the GPU culprit evidence on a GPU host (a down engine's
    is its log's error: `manifest`)."""
    verdict = inc.reason if inc.state == "frozen" else ""
    if gpu is None:
        return compose(findings, capture, verdict=verdict)
    views, c = gpu_views(gpu, findings)
    said = GpuSaid(c.culprit, c.sources, {v.name: v.gpu.value for v in views if v.gpu is not None})
    return compose(findings, capture, said, verdict)


def write_bundle(root: Path, inc: BundleHeader, capture: Capture, findings: Findings, context: Context,
                 gpu: GpuEvidence | None = None, runbook_base: str = "") -> Path:
    """Write the bundle atomically; returns its final directory. ``runbook_base``: where the runbooks are published
    (``[alerts] runbook_base``; "" names the project's runbooks/)."""
    partial = root / f"{PARTIAL}{inc.id}"
    final = root / inc.id
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial.mkdir(mode=0o700)
        (partial / "dumps").mkdir(mode=0o700)
        files: list[str] = []
        for i, rnd in [*enumerate(capture.rounds, 1), ("native", capture.native)]:
            for key, dump in rnd.items():
                # another node's title ends "on node X": two nodes' processes of one pid get two names
                title = next((p.title for p in capture.processes if p.id == key), "") or (
                    "process" if key.node == LOCAL else f"process on node {key.node}")
                which = f"round{i}" if isinstance(i, int) else str(i)
                name = f"dumps/{which}-{key.pid}-{title.replace('::', '-').replace('/', '_')}.json"
                _write(partial / name, dump.output if dump.ok else json.dumps({"error": dump.error}))
                files.append(name)
        for name, text in (("metrics.txt", context.metrics_page), ("log-tail.txt", context.log_tail),
                           ("gpu.csv", context.gpu)):
            if text:
                _write(partial / name, text)
                files.append(name)
        for node, nc in context.nodes.items():  # every other node's own log tail, beside ours
            if nc.log_tail:
                name = f"log-tail-{node}.txt"
                _write(partial / name, nc.log_tail)
                files.append(name)
        if gpu is not None:
            files += write_gpu_files(partial, gpu)
        if capture.rings:  # every ring read, its blocks and flags (docs/ring.md)
            _write(partial / "ring.json", json.dumps([ring_to_dict(r) for r in capture.rings], indent=2) + "\n")
            files.append("ring.json")
        said = None if inc.state == "down" else headline_of(inc, capture, findings, gpu)
        m = manifest(inc, capture, findings, context, files, said, runbook_base)
        if gpu is not None:
            m["gpu"] = gpu_manifest(gpu, findings)
        _write(partial / "summary.md", summary(m))
        _write(partial / "manifest.json", json.dumps(m, indent=2) + "\n")
        os.rename(partial, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise BundleError(f"cannot write incident bundle under {root}: {e.strerror or e}") from None
    return final


def said_of(bundle: Path) -> tuple[str, str]:
    """A written bundle's (headline, runbook name), as its manifest holds them; ("", "") when it cannot say."""
    try:
        m = json.loads((bundle / "manifest.json").read_text())
    except (OSError, ValueError):
        return "", ""
    return str(m.get("headline") or ""), str(m.get("runbook") or "")


def list_bundles(root: Path) -> list[dict[str, Any]]:
    """Complete bundles, oldest first. Partial ones (a crash mid-write) are never listed."""
    out: list[dict[str, Any]] = []
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if d.name.startswith(PARTIAL) or not (d / "manifest.json").is_file():
            continue
        try:
            m = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        m["path"] = str(d)
        out.append(m)
    return out


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def prune(root: Path, max_count: int, max_bytes: int, partial_age: float = 3600.0) -> list[str]:
    """Delete the oldest bundles beyond the limits, and partial ones older than ``partial_age``."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        if d.name.startswith(PARTIAL) and time.time() - d.stat().st_mtime > partial_age:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    bundles = [Path(m["path"]) for m in list_bundles(root)]
    sizes = {d: _size(d) for d in bundles}
    total = sum(sizes.values())
    while bundles and (len(bundles) > max_count or total > max_bytes):
        oldest = bundles.pop(0)
        total -= sizes[oldest]
        shutil.rmtree(oldest, ignore_errors=True)
        removed.append(oldest.name)
    return removed
