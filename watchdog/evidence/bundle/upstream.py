"""The text of a bug report for the engine's issue tracker, from one incident bundle (`watchdog show ID --upstream`).
Pure: what the CLI read of the bundle and the state directory in, Markdown out.

It says: versions (the bundle's, and what the frames' paths show: Python, the NVIDIA driver, the CUDA runtime),
the topology (ranks per node), the verdict and the page around the stall, the culprit and its node, the poll-parking
hypothesis, the known vLLM hang the evidence matches (its issues and PRs, the release that fixed it), each process's
deciding frames, the GPU evidence in short, and the timeline. Free text passes through `redact.scrub`
(docs/upstream-report.md gives the rules); the raw dumps are read only when the manifest cannot be, through the
parser, which never keeps locals; the log tail, the environment and the metrics page's text are never
taken at all.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from watchdog.core.roles import title_in
from watchdog.evidence.bundle.redact import one_line, scrub, short_path
from watchdog.evidence.bundle.timeline import Stall, hms, stall, suspected_at, timeline, wall_of
from watchdog.evidence.explain import known_hangs
from watchdog.evidence.explain.ranks import classify, cross_rank, poll_parking
from watchdog.evidence.stacks.parse import StackParseError, parse_any
from watchdog.scrape.page import PageError, read_page

MAX_FRAMES = 8
MAX_PROBLEMS = 8


@dataclass(frozen=True, slots=True)
class BundleFiles:
    """What the CLI read of one bundle and of the state directory around it; any part may be missing."""

    id: str
    manifest: dict[str, Any] | None = None
    unread: tuple[str, ...] = ()  # what could not be read, one line each: said at the top of the report
    dumps: tuple[tuple[int, str, str], ...] = ()  # (pid, title, py-spy output), latest round: used without manifest
    metrics_page: str = ""
    events: tuple[dict[str, Any], ...] = ()
    scrapes: tuple[dict[str, Any], ...] = ()  # the page trace's scrape records
    suspect_after: float | None = None


@dataclass(frozen=True, slots=True)
class Redaction:
    hosts: tuple[str, ...] = ()  # host names and addresses to take out besides every IP literal and URL host
    keep_addresses: bool = False


@dataclass(slots=True)
class _Proc:
    name: str
    role: str
    ranks: dict[str, int]
    node: str
    state: str
    cls: str
    thread: str
    why: str
    frames: list[dict[str, Any]]
    native: dict[str, Any] | None = None
    moved: bool | None = None
    cpu: float | None = None
    extra: list[str] = field(default_factory=list)


def _d(x: object) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _ls(x: object) -> list[Any]:
    return x if isinstance(x, list) else []


def _name(title: str, role: str, node: str) -> str:
    title = title.removesuffix(f" on node {node}")
    return title_in(title) or title or role or "process"


def _from_manifest(m: dict[str, Any]) -> list[_Proc]:
    out = []
    for p in map(_d, _ls(m.get("processes"))):
        node = str(p.get("node") or "local")
        ranks = {str(k): v for k, v in _d(p.get("ranks")).items() if isinstance(v, int)}
        out.append(_Proc(_name(str(p.get("title") or ""), str(p.get("role") or ""), node), str(p.get("role") or "?"),
                         ranks, node, str(p.get("state") or "?"), str(p.get("class") or "no stack"),
                         str(p.get("thread") or ""), str(p.get("why") or p.get("error") or ""),
                         [f for f in map(_d, _ls(p.get("frames"))) if f], _d(p.get("native")) or None,
                         p.get("moved") if isinstance(p.get("moved"), bool) else None,
                         p.get("cpu_seconds_between_captures")
                         if isinstance(p.get("cpu_seconds_between_captures"), int | float) else None))
    return out


def _from_dumps(files: BundleFiles, notes: list[str]) -> tuple[list[_Proc], dict[str, Any]]:
    """Without a manifest: classify the raw dumps again (one round, no /proc state: a stopped rank is not seen)."""
    expls = []
    for pid, title, text in files.dumps:
        try:
            stacks = parse_any(text)
        except StackParseError as e:
            notes.append(f"the dump of pid {pid} cannot be read: {e}")
            continue
        expls += [classify(replace(ps, pid=pid, title=title)) for ps in stacks]
    procs = [_Proc(e.name, str(e.role or "?"), dict(e.rank), "local", "?", e.cls.value, e.thread, e.why,
                   [{"function": f.function, "file": f.file, "line": f.line} for f in e.frames]) for e in expls]
    if not expls:
        return procs, {}
    cross, hyp = cross_rank(expls), poll_parking(expls, None, None)
    return procs, {"culprit": cross.culprit, "cross_rank": cross.reason,
                   "poll_parking": {"status": hyp.status.value, "reason": hyp.reason}}


def _rank(p: _Proc) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(p.ranks.items())) or "-"


def _topology(procs: list[_Proc], m: dict[str, Any]) -> tuple[str, list[str]]:
    sizes = {}
    for key in ("TP", "PP", "DP", "EP"):
        seen = {p.ranks[key] for p in procs if key in p.ranks}
        if seen:
            sizes[key] = max(seen) + 1
    short = ", ".join(f"{k}={n}" for k, n in sizes.items()) or "no ranks"
    nodes = list(_d(m.get("nodes"))) or sorted({p.node for p in procs}, key=lambda n: (n != "local", n))
    lines = [f"- parallelism: {short}; {len(nodes)} node{'s' if len(nodes) != 1 else ''}"]
    for n in nodes:
        here = [f"{p.name} ({_rank(p)})" if p.ranks else p.name for p in procs if p.node == n]
        where = "head (the watchdog's host)" if n == "local" else f"node {n}"
        entry = _d(_d(m.get("nodes")).get(n))
        held = "" if not entry else f"; evidence {entry.get('evidence', '?')}" + (
            "" if entry.get("reachable", True) else ", NOT REACHED")
        lines.append(f"- {where}: {', '.join(here) or 'no engine process found'}{held}")
    runs = {str(s).split()[0] for s in [m.get("log_source"), *(_d(e).get("log_source") for e in
                                                               _d(m.get("nodes")).values())] if str(s or "").split()}
    kinds = {"docker": "a Docker container", "journalctl": "a systemd unit"}
    said = sorted(kinds.get(r, "a process logging to a file") for r in runs)
    if said:
        lines.append(f"- engine run as: {', '.join(said)} (from where its log was read)")
    return short, lines


def _paths(m: dict[str, Any], files: BundleFiles) -> str:
    """Every raw file path the bundle holds in frames, to read versions from (never printed as such)."""
    texts = [t for _, _, t in files.dumps]
    for p in map(_d, _ls(m.get("processes"))):
        texts += [str(_d(f).get("file", "")) for f in [*_ls(p.get("frames")), *_ls(_d(p.get("native")).get("frames"))]]
    texts += [str(_d(f).get("file", "")) for f in _ls(_d(m.get("poll_parking")).get("frames"))]
    return "\n".join(texts)


def _versions(m: dict[str, Any], files: BundleFiles, version: str) -> list[str]:
    v = {str(k): str(x) for k, x in _d(m.get("versions")).items()}
    paths = _paths(m, files)
    found = {"vLLM": v.get("vllm"), "torch": v.get("torch")}
    if py := Counter(re.findall(r"python(\d\.\d+)/", paths)).most_common(1):
        found["Python"] = f"{py[0][0]} (from the frames' paths)"
    if drv := re.search(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)", paths):
        found["NVIDIA driver"] = f"{drv.group(1)} (libcuda in the stacks)"
    if rt := re.search(r"libcudart\.so\.(\d+(?:\.\d+)*)", paths):
        found["CUDA runtime"] = f"{rt.group(1)} (libcudart in the stacks)"
    elif cu := re.search(r"\+cu(\d+)(\d)$", v.get("torch", "")):
        found["CUDA"] = f"{cu.group(1)}.{cu.group(2)} (torch's build)"
    gpus = Counter(str(_d(r).get("name")) for r in _ls(_d(m.get("gpu")).get("readings")) if _d(r).get("name"))
    if gpus:
        found["GPUs"] = ", ".join(f"{n} x {name}" for name, n in gpus.items())
    found["py-spy"] = v.get("py-spy")
    found["engine-watchdog"] = f"{v['watchdog']} (bundle), {version} (this report)" if v.get("watchdog") and \
        v["watchdog"] != version else version
    lines = [f"- {k}: {x}" for k, x in found.items() if x]
    for node, entry in _d(m.get("nodes")).items():
        nv = {str(k): str(x) for k, x in _d(_d(entry).get("versions")).items()}
        differ = {k: x for k, x in nv.items() if v.get(k) != x}
        if node != "local" and differ:
            lines.append(f"- on node {node}: " + ", ".join(f"{k} {x}" for k, x in sorted(differ.items())))
    if not v:
        lines.append("- (the bundle records no versions)")
    return lines


def _page(files: BundleFiles, engine: str | None, st: Stall) -> list[str]:
    running, waiting, kv, model = st.running, st.waiting, st.kv, ""
    if files.metrics_page:
        try:
            engines = read_page(files.metrics_page).engines
        except (PageError, ValueError):
            engines = {}
        e = engines.get(engine or "") or (next(iter(engines.values())) if len(engines) == 1 else None)
        if e is not None:
            running, waiting, kv, model = e.running, e.waiting, e.kv_usage, short_path(e.model)
    if running is None and waiting is None:
        return ["- page at the capture: not read (no metrics page in the bundle)"]
    parts = [f"running={running:g}" if running is not None else "running=?",
             f"waiting={waiting:g}" if waiting is not None else "waiting=?"]
    if kv is not None:
        parts.append(f"KV cache {kv * 100:.1f} % used")
    return [f"- page at the capture: {', '.join(parts)}" + (f"; model {model}" if model else "")]


def _frame(f: dict[str, Any]) -> str:
    line = f":{f['line']}" if isinstance(f.get("line"), int) else ""
    return f"{f.get('function', '?')} ({short_path(str(f.get('file', '')))}{line})"


def _stack(p: _Proc, say: Any) -> list[str]:
    head = f"#### {p.name}" + (f" ({_rank(p)})" if p.ranks else "") + (f" on node {p.node}" if p.node != "local" else
                                                                       "")
    facts = [f"class **{p.cls}**", f"state {p.state}"]
    if p.thread:
        facts.append(f"thread {p.thread}")
    if p.moved is not None:
        facts.append(f"moved between captures: {'yes' if p.moved else 'no'}")
    if p.cpu is not None:
        facts.append(f"{p.cpu:g} CPU s between captures")
    out = [head, "", "; ".join(facts) + ". " + say(p.why, 300), ""]
    frames = p.frames[:MAX_FRAMES]
    if frames:
        out += ["```", *(f"  {_frame(f)}" for f in frames), "```"]
    nat = p.native
    if nat and _ls(nat.get("frames")) and nat.get("frames") != p.frames:
        out += ["", f"native (--native): class {nat.get('class')}", "```",
                *(f"  {_frame(_d(f))}" for f in _ls(nat.get("frames"))[:MAX_FRAMES]), "```"]
    return [*out, ""]


def _culprit(m: dict[str, Any], procs: list[_Proc], say: Any) -> list[str]:
    c = m.get("culprit")
    if not c:
        return [f"- culprit: none named: {say(m.get('cross_rank', 'no cross-rank verdict in the bundle'))}"]
    p = next((p for p in procs if p.name == c or p.name.endswith(str(c))), None)
    at = m.get("culprit_node") or (p.node if p else "local")  # no culprit_node in the manifest: the process's node
    node = "the head (the watchdog's host)" if at == "local" else f"node {at}"
    cls = f" ({p.cls})" if p else ""
    return [f"- culprit: **{c}**{cls} on {node}: {say(m.get('cross_rank', ''))}"]


def _gpu(m: dict[str, Any], say: Any) -> list[str]:
    g = _d(m.get("gpu"))
    if not g:
        return []
    why = say(g.get("culprit_reason") or "", 200)
    lines = [f"- GPU culprit: {g.get('culprit') or 'none named'}" + (f": {why}" if why else "")]
    seen = [f"GPU {r.get('index')} ({', '.join(map(str, _ls(r.get('ranks')))) or 'no rank'}): {r.get('state')}, "
            f"{r.get('util')} % at {r.get('power_w')} W" for r in map(_d, _ls(g.get("readings")))]
    if seen:
        lines.append("- " + say("; ".join(seen), 300) + (f"; {say(g['ras'], 200)}" if g.get("ras") else ""))
    return lines


def render(files: BundleFiles, red: Redaction, version: str) -> str:
    """The report's Markdown (see the module's doc)."""

    def say(text: object, limit: int = 400) -> str:
        return one_line(scrub(str(text), red.hosts, red.keep_addresses), limit)

    m = dict(files.manifest or {})
    notes = list(files.unread)
    procs = _from_manifest(m)
    if not procs and files.dumps:
        procs, said = _from_dumps(files, notes)
        m.update({k: v for k, v in said.items() if k not in m})
        notes.append("the processes were classified again from the raw dumps (one round, no /proc state)")
    elif not procs:
        notes.append("no process stacks: neither the manifest nor dumps/ name any")
    engine = str(m["engine"]) if "engine" in m else None
    created = wall_of(m.get("created"))
    short, topo = _topology(procs, m)
    st = stall(files.scrapes, engine, created, suspected_at(files.events, engine, files.id, created),
               files.suspect_after)
    state, kind = str(m.get("state") or "stalled"), str(m.get("stuck_kind") or "").replace("_", " ")
    c = next((p for p in procs if m.get("culprit") and p.name == m.get("culprit")), None)
    lead = say(m.get("headline") or (f"{c.name} {c.cls}" if c else m.get("decision_reason") or "no rank named"), 100)
    vllm = _d(m.get("versions")).get("vllm")
    out = [f"# [Bug]: {'vLLM ' + str(vllm) + ' ' if vllm else ''}engine {state}{f' ({kind})' if kind else ''} "
           f"with {short}: {lead}", ""]
    if notes:
        out += [f"> Partial report: {say(n, 300)}." for n in notes] + [""]
    out += ["### Your current environment", "", *_versions(m, files, version), "",
            "### Topology", "", *topo, "", "### What happened", ""]
    if created is not None:
        out.append(f"- verdict: **{state}** at {hms(created)} UTC ({str(m.get('created'))[:10]}): "
                   f"{say(m.get('reason', ''))}")
    if m.get("decision"):
        out.append(f"- the stacks say: **{m['decision']}**{f' ({kind})' if kind else ''}: "
                   f"{say(m.get('decision_reason', ''))}")
    out += _page(files, engine, st)
    secs = f"**{st.seconds:g} s**" if st.seconds is not None else "unknown"
    out.append(f"- no progress on the page when the stacks were taken: {secs} ({say(st.source)})")
    out += _culprit(m, procs, say)
    hyp = _d(m.get("poll_parking"))
    if hyp:
        out.append(f"- poll-parking hypothesis (every rank parked in its poll, no one working): "
                   f"**{hyp.get('status')}**: {say(hyp.get('reason', ''))}")
    if "known_hang" in m:  # bundles from the known-hang table on: the match, its sources, the fixing release
        out.append(f"- known vLLM hang: {say(known_hangs.said(m.get('known_hang')), 600)}")
    if "capture_complete" in m:
        fails = len(_ls(m.get("capture_failures")))
        out.append(f"- capture complete: {'yes' if m['capture_complete'] else 'NO'}"
                   + (f" ({fails} failed dumps)" if fails else ""))
    if _d(m.get("capture_options")).get("locals"):
        out.append("- the capture ran py-spy with --locals: no local value is in this report")
    gpu = _gpu(m, say)
    if gpu:
        out += ["", "### GPU evidence", "", *gpu]
    out += ["", "### Stacks (each process's deciding thread, innermost frame first)", ""]
    for p in procs:
        out += _stack(p, say)
    rows = timeline(files.events, engine, files.id, created)
    out += ["### Timeline (UTC)", ""]
    if rows:
        t0 = rows[0].wall
        out += ["| time | +s | what |", "| --- | --- | --- |",
                *(f"| {hms(r.wall)} | {r.wall - t0:+.1f} | {say(r.what, 240)} |" for r in rows)]
    else:
        out.append("- no events of this incident were found (the state directory's events.jsonl)"
                   + (f"; bundle written at {hms(created)}" if created is not None else ""))
    problems = [str(p) for p in _ls(m.get("problems"))]
    if problems:
        out += ["", "### Capture problems", "", *(f"- {say(p, 240)}" for p in problems[:MAX_PROBLEMS])]
        if len(problems) > MAX_PROBLEMS:
            out.append(f"- and {len(problems) - MAX_PROBLEMS} more (in the bundle)")
    kept = "kept (--keep-addresses)" if red.keep_addresses else "replaced with <host>"
    out += ["", "---", f"_Generated by engine-watchdog {version} from incident bundle `{files.id}` "
            f"(`watchdog show {files.id} --upstream`). Left out: the raw py-spy dumps and any --locals values, the "
            "engine's log, its environment and command line, prompts and request data, the metrics page beyond "
            f"running/waiting/KV. Addresses and host names {kept}; file paths cut to the package path or the "
            "file name; token- and password-like values replaced with <secret>. Read it before posting; share "
            "the bundle's dumps only after reading them._", ""]
    return "\n".join(out)

