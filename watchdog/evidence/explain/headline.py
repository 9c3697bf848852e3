"""The headline of a freeze: what happened, from the cause down, in the one sentence an operator reads first (the
top of summary.md, the event and the log line of a stack-confirmed freeze, the alerts), and the runbook page of that
cause. Pure: findings in, words out.

The decision (stuck, working, undecided) is `findings`'; this module only says it. The cause is looked for in
order: the loop's own faults (livelock, admission stall), a stopped rank, a rank that is gone, a rank waiting on
its own GPU (the GPU culprit evidence first, then the stacks), a collective waiting on a peer (named, idle, or on a
node whose stacks could not be taken), EngineCore waiting on a worker, EngineCore sending nothing, and last every
rank parked with nobody to blame (the poll-parking question). Each process is named with its node when it is not
on this host, so a two-node freeze says where to look.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from watchdog.core.processes import Capture, Failure
from watchdog.core.roles import ENGINE_ROLES, Role
from watchdog.core.runbooks import Runbook
from watchdog.core.types import Decision
from watchdog.evidence.explain.classes import Cls
from watchdog.evidence.explain.findings import Findings, ProcessFinding, StuckKind
from watchdog.evidence.explain.frame_rules import COLL_FUNC, COLL_NATIVE, base_name, is_noise
from watchdog.evidence.explain.ring_said import ring_readers

_LAUNCH = re.compile(r"^cu(?:da)?LaunchKernel")
_GLOSS = {  # what the poll-parking status means, in a few words
    "SUPPORTED": "SUPPORTED: work pending and every worker parked in its reader (a lost wake-up or an unread block)",
    "CONTRADICTED": "CONTRADICTED",
    "INCONCLUSIVE": "INCONCLUSIVE",
    "NOT_APPLICABLE": "NOT_APPLICABLE: no work pending",
}


@dataclass(frozen=True, slots=True)
class Headline:
    text: str
    runbook: Runbook
    culprit: str | None = None  # the process the sentence blames (its explanation's name: Worker_TP1)
    node: str | None = None  # the node the culprit runs on ("local": this host); None without a culprit


def _and(names: Sequence[str]) -> str:
    names = list(dict.fromkeys(names))
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


MAX_NAMED = 6  # a group larger than this is counted, its first two and last named: a headline stays one line


def _group(procs: Sequence[ProcessFinding]) -> str:
    """The processes of one group by name, or past `MAX_NAMED` counted: "61 processes on 8 nodes (Worker_TP0 on
    node node0, Worker_TP1 on node node0 ... Worker_TP63 on node node7)"."""
    names = list(dict.fromkeys(_who(p) for p in procs))
    if len(procs) <= MAX_NAMED:
        return _and(names)
    nodes = {p.process.node for p in procs}
    where = f" on {len(nodes)} nodes" if len(nodes) > 1 else ""
    named = f"{names[0]}, {names[1]} ... {names[-1]}" if len(names) > 2 else _and(names)
    return f"{len(procs)} processes{where} ({named})"  # by count: two engines' Worker_TP0 share a name


def _name(p: ProcessFinding) -> str:
    """Its explanation's name (Worker_TP1), or its title's when it could not be read."""
    return p.explanation.name if p.explanation else p.process.title.split("::")[-1].split(" ")[0] or p.process.label


def _who(p: ProcessFinding) -> str:
    name, node = _name(p), p.process.node
    return name if node == "local" or name.endswith(f" on node {node}") else f"{name} on node {node}"


def _cls(p: ProcessFinding) -> Cls | None:
    return p.explanation.cls if p.explanation else None


def _frames(p: ProcessFinding) -> list[str]:
    """Every deciding frame's function of a process, its native dump's too (where a GPU rank's waits show)."""
    return [f.function for e in (p.explanation, p.native) if e is not None for f in e.frames]


def collective(p: ProcessFinding) -> str:
    """The collective a process waits in, by its innermost collective frame (all_gather, ncclAllReduce), or ""."""
    for e in (p.explanation, p.native):
        for f in e.frames if e is not None else ():
            if (f.native and COLL_NATIVE.search(f.function)) or (not f.native and COLL_FUNC.search(base_name(f))):
                return base_name(f)
    return ""


def _op(p: ProcessFinding) -> str:
    """The innermost meaningful frame of what a process waits in (cudaDeviceSynchronize, sched_yield)."""
    e = p.native if p.native is not None and p.native.cls is Cls.DEVICE_WAIT else p.explanation
    frames = [f for f in (e.frames if e else ()) if not is_noise(f)] or list(e.frames[:1] if e else ())
    return base_name(frames[0]) if frames else ""


def _gone(p: ProcessFinding, capture: Capture | None) -> bool:
    if p.state[:1] in ("Z", "X"):
        return True
    dumps = capture.dumps_of(p.process) if capture else []
    return any(d.failure is Failure.GONE for d in dumps)


_GPU_WORDS = {  # a GPU's state (evidence.gpu.readings.GpuState's values): what it adds to a rank's own device wait
    "spinning": ", its GPU busy at idle power (a kernel that spins or never ends)",
    "working": ", its GPU busy at full power (a long or endless kernel)",
    "idle": ", its GPU idle",
}


def _own_gpu(p: ProcessFinding, gpus: Mapping[str, str]) -> str:
    """ "Worker_TP1 waits on its own GPU (cudaDeviceSynchronize), its GPU busy at idle power (...)"."""
    state = gpus.get(p.explanation.name, "") if p.explanation else ""
    return f"{_who(p)} waits on its own GPU ({_op(p)}){_GPU_WORDS.get(state, '')}"


def _stopped_how(state: str) -> str:
    return "held by a debugger: tracing stop" if state[:1] == "t" else "SIGSTOP or a debugger"


def _doing(p: ProcessFinding, culprit: ProcessFinding | None, workers: int) -> str:
    """What one other process does, said against the culprit ("waits for it in all_gather")."""
    cls, it = _cls(p), "it" if culprit is not None else "a peer"
    if cls is Cls.IN_COLLECTIVE:
        coll = collective(p)
        return f"waits for {it} in {coll}" if coll else f"waits for {it} in a collective"
    if any(_LAUNCH.search(fn) for fn in _frames(p)):
        return f"is blocked launching a kernel behind {it}"
    if cls is Cls.ENGINE_WAITING_WORKERS:
        if culprit is None or culprit.process.role != Role.WORKER:
            return "waits for its workers' replies"
        return "waits for it" if workers == 1 else "waits for both" if workers == 2 else f"waits for all {workers}"
    if cls is Cls.IDLE_READER_WAIT:
        return ("waits in its reader for its next step" if culprit is not None and culprit.process.role ==
                Role.ENGINE_CORE else "waits in its reader for the next step")
    said = {Cls.STOPPED: "is stopped too", Cls.DEVICE_WAIT: f"waits on its own GPU ({_op(p)})",
            Cls.ENGINE_IDLE: "waits for requests", Cls.WRITER_BLOCKED_FULL_RING: "cannot write: its ring is full",
            Cls.ENGINE_LOOP: "turns its own loop", Cls.MODEL_FORWARD: "is in the model",
            Cls.COMPILE: "is compiling"}
    if cls in said:
        return said[cls]
    if cls is None:
        return f"could not be read ({p.error})"
    return f"is in no recognised frame ({_op(p) or 'no frames'})" if cls is Cls.UNKNOWN else f"is {cls.value}"


_PLURAL = ((r"^waits\b", "wait"), (r"^is\b", "are"), (r"^turns\b", "turn"), (r" its reader\b", " their readers"),
           (r" its own GPU\b", " their own GPUs"), (r" its workers'", " their workers'"),
           (r" its ring\b", " their ring"))


def _rest(procs: list[ProcessFinding], culprit: ProcessFinding | None, skip: Sequence[ProcessFinding] = ()) -> str:
    """The others, grouped by what they do, the ranks before EngineCore when someone is blamed (from the cause
    down): "; Worker_TP0 waits for it in all_gather; EngineCore waits for both"."""
    workers = sum(1 for p in procs if p.process.role == Role.WORKER)
    others = [p for p in procs if p is not culprit and p not in skip]
    if culprit is not None:
        others.sort(key=lambda p: p.process.role == Role.ENGINE_CORE)
    groups: dict[str, list[ProcessFinding]] = {}
    for p in others:
        groups.setdefault(_doing(p, culprit, workers), []).append(p)
    parts = []
    for doing, members in groups.items():
        said = doing
        for pattern, plural in _PLURAL if len({_who(p) for p in members}) > 1 else ():
            said = re.sub(pattern, plural, said)
        parts.append(f"{_group(members)} {said}")
    return "".join(f"; {p}" for p in parts)


def _said(text: str, runbook: Runbook, culprit: ProcessFinding | None = None) -> Headline:
    if culprit is None:
        return Headline(text, runbook)
    return Headline(text, runbook, _name(culprit), culprit.process.node)


def _missing(procs: list[ProcessFinding]) -> list[str]:
    """Workers missing from a run of ranks (Worker_TP0 and Worker_TP2 found: Worker_TP1 missing)."""
    tps = {p.process.ranks["TP"]: p for p in procs if p.process.role == Role.WORKER and "TP" in p.process.ranks}
    if not tps:
        return []
    name = _who(next(iter(tps.values()))).split(" ")[0]
    return [re.sub(r"TP\d+", f"TP{n}", name) for n in range(max(tps)) if n not in tps]


@dataclass(frozen=True, slots=True)
class GpuSaid:
    """What a GPU host's evidence adds (evidence.gpu, a floor above: handed in as plain words): the culprit GPU rank
    (evidence.gpu.culprit), the sources that named it, and each rank's GPU state by name (GpuState's value)."""

    culprit: str | None = None
    sources: tuple[str, ...] = ()
    states: Mapping[str, str] = field(default_factory=dict)


def _lost_wakeup(procs: list[ProcessFinding], capture: Capture | None) -> Headline:
    """The readers parked with a block written for them; the peers that took the step (remote readers) wait for
    them. Blamed: the parked rank when some peer did its part, nobody when every rank is parked."""
    readers = ring_readers(tuple(r for r in capture.rings if r.ok)) if capture is not None else None
    parked = [p for p in procs if _cls(p) is Cls.IDLE_READER_WAIT and (readers or {}).get(_name(p)) is not None]
    if not parked or readers is None:  # cannot happen for this kind; said plainly all the same
        return _said("lost wake-up: the readers are parked with a block written for them", Runbook.ALL_PARKED)
    blocks = sorted({b for p in parked if (b := readers.get(_name(p))) is not None})
    one = len(parked) == 1
    block = f"block{'s' * (len(blocks) > 1)} {_and([str(b) for b in blocks])}"
    took = [p for p in procs if _cls(p) is Cls.IN_COLLECTIVE]
    text = (f"lost wake-up: {_group(parked)} {'is' if one else 'are'} parked in "
            f"{'its' if one else 'their'} reader with {block} written for {'it' if one else 'them'} and never read")
    if took:
        colls = _and(sorted({collective(p) or "a collective" for p in took}))
        text += (f"; {_group(took)} took the step and wait{'s' * (len(took) == 1)} in {colls} for "
                 f"{'it' if one else 'them'}")
    culprit = parked[0] if took and one else None
    return _said(f"{text}{_rest(procs, culprit, parked + took)}", Runbook.ALL_PARKED, culprit)


def compose(f: Findings, capture: Capture | None = None, gpu: GpuSaid | None = None, verdict: str = "") -> Headline:
    """The headline of ``f``. ``capture``: the capture it was made from (unseen nodes, ranks gone); ``gpu``: a GPU
    host's evidence; ``verdict``: the freeze's own reason, said first when the stacks cannot say why."""
    procs = [p for p in f.processes if p.process.role in ENGINE_ROLES]
    by_name = {p.explanation.name: p for p in procs if p.explanation}
    unseen = capture.unseen_nodes if capture is not None else ()
    gpus = gpu.states if gpu is not None else {}
    engine = next((p for p in procs if p.process.role == Role.ENGINE_CORE), None)
    if f.decision is Decision.STUCK and f.stuck_kind in (StuckKind.LIVELOCK, StuckKind.ADMISSION_STALL):
        rb = Runbook.LIVELOCK if f.stuck_kind is StuckKind.LIVELOCK else Runbook.ADMISSION_STALL
        # the rule's own words run from the cause (EngineCore's loop); a livelock's ranks wait on it (an admission
        # stall's pass through empty steps: what one capture caught of them says nothing)
        rest = _rest(procs, engine) if f.stuck_kind is StuckKind.LIVELOCK else ""
        return _said(f"{f.reason}{rest}", rb, engine)
    if f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LOST_WAKEUP:
        return _lost_wakeup(procs, capture)
    if f.decision is Decision.STUCK and f.stuck_kind is StuckKind.DIVERGED:
        coll = [p for p in procs if _cls(p) is Cls.IN_COLLECTIVE]
        done = [p for p in procs if p.explanation is not None and p.explanation.name == f.cross_rank.culprit]
        by_op: dict[str, list[ProcessFinding]] = {}
        for p in coll:
            by_op.setdefault(collective(p) or "a collective", []).append(p)
        each = _and([f"{_group(ps)} wait{'s' * (len(ps) == 1)} in {op}" for op, ps in by_op.items()])
        fin = f"; {_group(done)} finished the step and waits in its reader" if done else ""
        return _said(f"the ranks diverged: {each}, collectives that never match{fin}{_rest(procs, None, coll + done)}",
                     Runbook.DIVERGED, done[0] if done else None)
    if f.decision is Decision.WORKING:
        return _said(f"the stacks show work, not a freeze: {f.reason}", Runbook.FROZEN)
    if f.decision is Decision.IDLE:
        return _said(f"an idle engine, not a freeze: {f.reason}", Runbook.FROZEN)
    if stopped := [p for p in procs if _cls(p) is Cls.STOPPED]:
        c = next((p for p in stopped if p.explanation and p.explanation.name == f.cross_rank.culprit), stopped[0])
        return _said(f"{_who(c)} is stopped ({_stopped_how(c.state)}){_rest(procs, c)}", Runbook.STOPPED_RANK, c)
    if gone := [p for p in procs if _gone(p, capture)]:
        c = gone[0]
        return _said(f"{_who(c)} is gone (its process exited){_rest(procs, c)}", Runbook.PEER_WAIT, c)
    if gpu is not None and gpu.culprit in by_name:
        c = by_name[gpu.culprit]
        src = f" (named by {', '.join(gpu.sources)})" if gpu.sources else ""
        if _cls(c) is Cls.DEVICE_WAIT or (c.native is not None and c.native.cls is Cls.DEVICE_WAIT):
            return _said(f"{_own_gpu(c, gpus)}{src}{_rest(procs, c)}", Runbook.GPU_WAIT, c)
        return _said(f"{_who(c)} is behind its peers' collective{src}: it {_doing(c, None, 0)}{_rest(procs, c)}",
                     Runbook.PEER_WAIT, c)
    device = [p for p in procs if _cls(p) is Cls.DEVICE_WAIT]
    coll = [p for p in procs if _cls(p) is Cls.IN_COLLECTIVE]
    named = by_name.get(f.cross_rank.culprit or "")
    if len(device) == 1 and (named is None or named is device[0]):
        c = device[0]
        return _said(f"{_own_gpu(c, gpus)}{_rest(procs, c)}", Runbook.GPU_WAIT, c)
    if coll and named is not None and named not in coll:
        if _cls(named) is Cls.IDLE_READER_WAIT:
            what = (f"{_who(named)} is back in its idle reader loop, out of the collective its peers wait in: it left "
                    f"or skipped that collective (a failed or desynchronised step)")
        else:
            what = f"{_who(named)} is not in the collective its peers wait in: it {_doing(named, None, 0)}"
        return _said(f"{what}{_rest(procs, named)}", Runbook.PEER_WAIT, named)
    if coll:
        where = _and(sorted({collective(p) or "a collective" for p in coll}))
        if unseen:
            peers = (f"its peers on node{'s' if len(unseen) > 1 else ''} {_and(unseen)}, whose stacks could not be "
                     "taken")
        elif missing := _missing(procs):
            peers = f"{_and(missing)}, not among the engine's processes (exited, or never found)"
        else:
            peers = ("every rank seen is in it too: the transport (NCCL, gloo, the network) or a rank missing from "
                     "the dump is stuck")
        return _said(f"{_group(coll)} wait{'s' if len(coll) == 1 else ''} in {where} for {peers}"
                     f"{_rest(procs, None, coll)}", Runbook.PEER_WAIT)
    if named is not None and named.process.role == Role.ENGINE_CORE:
        return _said(f"{_who(named)} sends no next step: it {_doing(named, None, 0)}"
                     f"{_rest(procs, named)}", Runbook.ALL_PARKED, named)
    if named is not None:
        return _said(f"{_who(named)} has not finished its step: it {_doing(named, None, 0)}{_rest(procs, named)}",
                     Runbook.PEER_WAIT, named)
    if unseen:
        return _said(f"no stacks from node{'s' if len(unseen) > 1 else ''} {_and(unseen)}: the ranks seen"
                     f"{_rest(procs, None).replace(';', ':', 1)}", Runbook.BLIND_NODE)
    if f.decision is Decision.STUCK:
        return _said(f"every rank is parked and nothing moved between captures{_rest(procs, None)}; no rank to "
                     f"blame; poll-parking hypothesis {_GLOSS[f.hypothesis.status.value]}", Runbook.ALL_PARKED)
    why = f"the stacks could not say why: {f.reason}"
    return _said(verdict if verdict and f.reason in verdict else f"{verdict}; {why}" if verdict else why,
                 Runbook.FROZEN)
