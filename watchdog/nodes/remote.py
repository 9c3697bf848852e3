"""The other nodes in the evidence and act stages: their captures beside ours, their context in the bundle, their
restart steps run there.

- `RemoteEvidence.capture_with(local)`: the local capture and every node's (``stacks`` through its agent: two
  rounds, the same gap) run in parallel and are merged into one `Capture`; another node's process keeps its own pid
  and is keyed by (node, pid) (`ProcessId`: pids of two nodes collide); a node that cannot be reached is a capture
  problem of that node, never silence;
- `RemoteEvidence.context(base)`: every node asked at once (a dead node costs its own call's timeout, not the
  others'), each node's own log tail (the source its ``[[nodes]]`` entry names, read only if
  that node's agent config allows exactly it; none named: the node's own), versions, /dev/shm segments and clock
  offset, kept per node in the bundle's context;
- `SshRunner`: a restart `Runner` for one node (the agent runs the command only if that node's config allows it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from watchdog.config.load import Config
from watchdog.core.processes import Capture, Dump, EngineProcess, NodeContext, NodeReach, Problem, ProcessId
from watchdog.core.ring import Ring
from watchdog.core.roles import ENGINE_ROLES
from watchdog.evidence.collect.capture import NO_ENGINE
from watchdog.evidence.collect.context import RING_WARNING, Context
from watchdog.host.run import RunResult, exit_text
from watchdog.nodes.protocol import (
    MAX_RINGS,
    ProtocolError,
    clean,
    dump_from_json,
    log_wanted,
    number,
    pid_of,
    process_from_json,
    ring_from_json,
)
from watchdog.nodes.transport import NodeError, NodeLink

RING_TIMEOUT = 20.0  # the agent's `ring`: /proc maps and a few small reads


@dataclass(frozen=True, slots=True)
class NodeCapture:
    node: str
    processes: tuple[EngineProcess, ...] = ()
    rounds: tuple[dict[ProcessId, Dump], ...] = ()
    problems: tuple[Problem, ...] = ()
    clock_offset: float | None = None  # the node's wall clock minus ours, seconds (low by the answer's way back)
    reachable: bool = True  # False: the call did not get through (unreachable, timed out)
    failed: bool = False  # no stacks from this node at all (the call or its answer failed)
    rings: tuple[Ring, ...] = ()  # its broadcast rings' flags, read by its agent after the stacks (`ring`)


class RemoteEvidence:
    def __init__(self, cfg: Config, links: Mapping[str, NodeLink], wall: Callable[[], float] = time.time) -> None:
        """``links``: one per node (`transport.open_links`), shared with the other stages; their owner closes them.
        ``wall``: this host's wall clock, against which each node's clock offset is measured."""
        self.cfg, self.links, self.wall = cfg, links, wall
        self.offsets: dict[str, float] = {}

    def _capture(self, name: str) -> NodeCapture:
        c = self.cfg.capture
        args = {"rounds": c.rounds, "gap": c.gap, "timeout": c.timeout, "native": c.native, "locals": c.locals}
        budget = c.rounds * (2 * c.timeout) + c.gap * c.rounds + 15
        try:
            a = self.links[name].call("stacks", args, timeout=budget)
            got = self.wall()
            cap = a.get("capture")
            if not isinstance(cap, dict) or not isinstance(cap.get("processes"), list) \
                    or not isinstance(cap.get("rounds"), list) or len(cap["rounds"]) > 16:
                raise ProtocolError("the answer holds no capture (processes and rounds)")
            procs: dict[int, EngineProcess] = {}
            for d in cap["processes"]:
                p = process_from_json(d, name)
                if p.pid in procs:
                    raise ProtocolError(f"pid {p.pid} listed twice")
                procs[p.pid] = p
            rounds = tuple({ProcessId(name, pid): dump_from_json(x, pid, 0.0)
                            for x in _objects(r) if (pid := pid_of(x.get("pid"))) in procs} for r in cap["rounds"])
            # the node stamps its answer ("wall") as it sends it, after the capture's seconds: its clock minus ours is
            # wall - got, low by the answer's way back and the agent's exit (tens of ms); against the middle of the
            # call it would be off by half the capture
            self.offsets[name] = round(number(a.get("wall"), "wall") - got, 3)
            problems = tuple(Problem(clean(p), name) for p in _strings(cap.get("problems")))
            return NodeCapture(name, tuple(procs.values()), rounds, problems, self.offsets[name],
                               rings=self._rings(name))
        except NodeError as e:
            if e.kind in ("unreachable", "timeout", "host_key", "auth"):  # the call did not get through
                return NodeCapture(name, problems=(Problem(f"unreachable: no stacks: {e.message}", name),),
                                   reachable=False, failed=True)
            return NodeCapture(name, problems=(Problem(f"no stacks: {e.message}", name),), failed=True)
        except ProtocolError as e:
            return NodeCapture(name, problems=(Problem(f"no stacks: {clean(e)}", name),), failed=True)

    def _rings(self, name: str) -> tuple[Ring, ...]:
        """The node's broadcast rings as its agent read them; a failed call is said as a ring not read."""
        try:
            got = self.links[name].call("ring", {}, timeout=RING_TIMEOUT).get("rings")
            if not isinstance(got, list) or len(got) > MAX_RINGS:
                raise ProtocolError("the answer holds no rings")
            return tuple(ring_from_json(d, name) for d in got)
        except NodeError as e:
            return (Ring("", name, error=f"ring not read: {clean(e.message)}"),)
        except ProtocolError as e:
            return (Ring("", name, error=f"ring not read: {clean(e)}"),)

    def capture_with(self, local: Callable[[], Capture]) -> Capture:
        names = list(self.links)
        with ThreadPoolExecutor(max_workers=len(names) + 1, thread_name_prefix="node-capture") as pool:
            mine = pool.submit(local)
            theirs = [pool.submit(self._capture, n) for n in names]
            base = mine.result()
            remote = [f.result() for f in theirs]
        return merge(base, remote)

    def _context(self, name: str, link: NodeLink) -> dict[str, Any] | NodeError:
        node = next(n for n in self.cfg.nodes if n.name == name)
        wanted = log_wanted(node.journal_unit, node.docker_container, node.log_file)
        try:
            return link.call("context", {"lines": node.log_lines, "log": wanted})
        except NodeError as e:
            return e

    def context(self, base: Context) -> Context:
        """Each node's own log tail (the one its ``[[nodes]]`` entry names, if that node allows it; else the node's
        own), versions, /dev/shm segments; kept per node (`Context.nodes`), and the versions also in `Context.versions`
        as ``"<name> (node <node>)"``."""
        versions, problems, nodes = dict(base.versions), list(base.problems), dict(base.nodes)
        ring = base.ring_warnings
        with ThreadPoolExecutor(max_workers=max(1, len(self.links)), thread_name_prefix="node-context") as pool:
            asked = {name: pool.submit(self._context, name, link) for name, link in self.links.items()}
            answers = {name: f.result() for name, f in asked.items()}  # each call bounded by its node's timeout
        for name, a in answers.items():
            if isinstance(a, NodeError):
                lost = "unreachable" if a.kind in ("unreachable", "timeout") else "refused"
                problems.append(Problem(f"{lost}: no context: {a.message}", name))
                nodes[name] = NodeContext(False, problems=(problems[-1],))
                continue
            got_tail = a.get("log_tail")
            tail = got_tail if isinstance(got_tail, str) else ""
            ring += tail.count(RING_WARNING)
            got = a.get("versions")
            theirs = {clean(k, 80): clean(v, 200) for k, v in list(got.items())[:64]} if isinstance(got, dict) else {}
            versions.update({f"{k} (node {name})": v for k, v in theirs.items()})
            if name in self.offsets:
                versions[f"clock offset s (node {name})"] = str(self.offsets[name])
            shm = a.get("shm")
            if shm:
                versions[f"shm segments (node {name})"] = str(len(shm)) if isinstance(shm, list) else "?"
            mine = (Problem(clean(a["problem"]), name),) if a.get("problem") else ()
            problems.extend(mine)
            nodes[name] = NodeContext(True, tail, clean(a.get("log_source") or ""), theirs,
                                      len(shm) if isinstance(shm, list) else None, mine)
        return replace(base, versions=versions, problems=tuple(problems), nodes=nodes, ring_warnings=ring)


def _objects(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
        raise ProtocolError("a round is not a list of dumps")
    return value


def _strings(value: object) -> list[str]:
    return [x for x in value[:100] if isinstance(x, str)] if isinstance(value, list) else []


def merge(base: Capture, remote: Sequence[NodeCapture]) -> Capture:
    processes = list(base.processes)
    rounds = [dict(r) for r in base.rounds]
    problems = list(base.problems)
    if not base.processes and any(r.processes for r in remote):  # "nothing found" meant here only
        problems = [p for p in problems if p != Problem(NO_ENGINE)]
    for r in remote:
        processes.extend(r.processes)
        for i, rnd in enumerate(r.rounds):
            if i < len(rounds):
                rounds[i].update(rnd)
        problems.extend(r.problems)
    return Capture(tuple(processes), tuple(rounds), tuple(problems), dict(base.options), dict(base.native),
                   rings=(*base.rings, *(x for r in remote for x in r.rings)),
                   unseen_nodes=tuple(r.node for r in remote if r.failed or not any(
                       p.role in ENGINE_ROLES for p in r.processes)),
                   nodes=tuple(NodeReach(r.node, len(r.processes), r.clock_offset, r.reachable) for r in remote))


class SshRunner:
    """Runs a restart command on one node through its agent (which runs it only if that node allows it)."""

    def __init__(self, link: NodeLink) -> None:
        self.link = link

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        started = time.monotonic()
        try:
            a = self.link.call("run", {"argv": list(argv), "timeout": timeout}, timeout=timeout + 15)
        except NodeError as e:
            return RunResult(tuple(argv), None, time.monotonic() - started, e.kind == "timeout", error=e.message)
        rc, duration = a.get("rc"), a.get("duration")
        rc = rc if isinstance(rc, int) and not isinstance(rc, bool) else None
        error = clean(a["error"], 500) if a.get("error") else (exit_text(rc) if rc else "")
        if rc is None and not error:
            error = "the agent's answer holds no exit status"
        return RunResult(tuple(argv), rc,
                         float(duration) if isinstance(duration, int | float) and 0 <= duration < 1e6 else 0.0,
                         a.get("timed_out") is True, clean(a.get("output") or "", 4096, "\n\t"), error)


def node_runners(links: Mapping[str, NodeLink]) -> dict[str, SshRunner]:
    """A restart runner per node, over its link ("local" is the caller's own)."""
    return {name: SshRunner(link) for name, link in links.items()}
