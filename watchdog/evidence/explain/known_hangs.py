"""Known vLLM hangs, with the release that fixed them: a small table (each entry with its sources, vLLM's issue and
PR numbers) and a matcher that reads ONLY the evidence (the explained stacks and findings, the broadcast ring's flags,
the log tail) and the engine's own vLLM version. Pure: data in, words out.

The table is read from vLLM's wheels 0.25.1 to 0.34.0 and its tracker (the project's notes on known hangs). A fix is
said against the version the bundle read: older, "upgrade"; the fix in, "not that bug" (a new one, worth reporting);
the version not read, both sides said. An open one says so ("open upstream (not fixed as of 0.34.0)"). Nothing
matching is said as no match, never as a guess.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from watchdog.core.processes import Capture, Failure
from watchdog.core.ring import Ring
from watchdog.core.roles import Role
from watchdog.core.types import Decision
from watchdog.evidence.explain.classes import Cls, Status
from watchdog.evidence.explain.findings import Findings, ProcessFinding, StuckKind

NO_MATCH = "no known vLLM hang matches this evidence"
CHECKED_UP_TO = "0.34.0"  # the newest wheel whose code the table was checked against
# EngineCore's line while it waits on a worker's reply (workers never print it from 0.25.1 on: indefinite reads)
RING_LINE = "No available shared memory broadcast block found in 60 seconds"
_RPC_TIMEOUT = re.compile(r"RPC call to (\w+) timed out")


@dataclass(frozen=True, slots=True)
class KnownHang:
    id: str
    title: str  # what it is, said after "known hang: " ("the lost wake-up")
    refs: tuple[str, ...]  # the numbers said in the sentence ("#45224")
    sources: tuple[str, ...]  # where it is told, in full
    cause: str
    fixed_in: str | None  # the first release with the fix; None: open
    after_fix: str = ""  # said when the engine has the fix: why this is then not that bug
    then: str = ""  # and what it is then
    advice: str = ""  # said for an open one: what to do


LOST_WAKEUP = KnownHang(
    "lost_wakeup", "the lost wake-up", ("#45224",),
    ("vLLM PR #45224: shm_broadcast: bound idle reader waits and release read slots",),
    "a local reader parked in its poll waits forever on the best-effort ZMQ notify after the writer wrote the ring "
    "(the writer's PUB socket, SNDHWM=1, drops silently; the reader's SUB is CONFLATE)", "0.27.0",
    after_fix="0.27.0+ re-checks every 5 s: a parked reader that stays parked is not the lost wake-up #45224 fixed",
    then="a new hang, worth reporting upstream")
NEGATIVE_RPC_TIMEOUT = KnownHang(
    "negative_rpc_timeout", "the negative RPC timeout", ("#40926", "#41357"),
    ("vLLM issue #40926 (root cause)", "vLLM PR #41357 (clamp the timeout)"),
    "a stale RPC deadline makes EngineCore's reply timeout negative, which ZMQ reads as wait forever: vLLM's own "
    "300 s RPC timeout never fires (a sample_tokens hang after 0.20.0)", "0.27.0",
    after_fix="0.27.0+ clamps the timeout (#41357): EngineCore's wait there has a deadline",
    then="vLLM's own RPC timeout (300 s) still ends it")
WRITER_AFTER_DEATH = KnownHang(
    "writer_spins_after_worker_death", "the writer spinning in acquire_write after a worker died", ("#45644",),
    ("vLLM PR #45644 (closed unmerged)",),
    "acquire_write(timeout=None) does not honour shutdown: EngineCore spins on the full ring for ever", None,
    advice="restart the engine (vLLM's own 300 s RPC timeout does not cover the writer)")
WORKER_HUNG_IN_STEP = KnownHang(
    "worker_hung_in_step", "EngineCore waiting over 60 s for a worker's reply",
    ("#40926", "#41530", "#48752", "#37250"),
    ("vLLM issue #40926", "vLLM issue #41530", "vLLM issue #48752", "vLLM issue #37250", "candidate fix: vLLM #47928"),
    "a worker hung inside a step (reported mostly with MTP / speculative decoding and async scheduling); vLLM's "
    "300 s VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS surfaces it as EngineDeadError", None,
    advice="the line is also printed while compiling or loading weights; the stacks name the rank")

KNOWN: tuple[KnownHang, ...] = (LOST_WAKEUP, NEGATIVE_RPC_TIMEOUT, WRITER_AFTER_DEATH, WORKER_HUNG_IN_STEP)


def version_key(text: str) -> tuple[tuple[int, int, int], int] | None:
    """A vLLM version as a comparable key, PEP 440's order for what vLLM ships: the release (0.25.1), below it its
    pre-releases and dev builds (0.27.0rc1, 0.27.0.dev5), a local label ignored (0.25.1+cpu, 0.32.0+g1a2b.cu128).
    None when it is not a version at all."""
    m = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:\.\d+)*(\.?(?:a|b|rc|c|dev|pre|post)\.?\d*)?", text or "")
    if m is None:
        return None
    release = (int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0))
    tag = (m.group(4) or "").lstrip(".")
    return release, 1 if not tag or tag.startswith("post") else 0


def has_fix(version: str, fixed_in: str) -> bool | None:
    """Whether ``version`` carries a fix first released in ``fixed_in``; None when the version is not known."""
    v, f = version_key(version), version_key(fixed_in)
    return None if v is None or f is None else v >= f


@dataclass(frozen=True, slots=True)
class Match:
    hang: KnownHang
    seen: tuple[str, ...]  # what in the evidence matched, one fact each
    version: str  # the engine's vLLM version as read ("" when not)

    @property
    def status(self) -> str:
        """affected (older than the fix) | fixed (the engine has it: not that bug) | open | version_unknown."""
        if self.hang.fixed_in is None:
            return "open"
        return {True: "fixed", False: "affected", None: "version_unknown"}[has_fix(self.version,
                                                                                    self.hang.fixed_in)]

    @property
    def advice(self) -> str:
        h, fixed = self.hang, self.hang.fixed_in
        said = {"affected": f"this engine runs {self.version}: upgrade to {fixed} or later",
                "fixed": f"this engine runs {self.version}, which has the fix ({h.after_fix}); {h.then}",
                "version_unknown": f"this engine's vLLM version was not read: if older than {fixed}, upgrade to "
                                   f"{fixed} or later",
                "open": f"open upstream (not fixed as of {CHECKED_UP_TO}); {h.advice}"}
        return said[self.status]

    @property
    def clause(self) -> str:
        """The words the headline ends with: "known hang: the lost wake-up fixed by vLLM #45224 in 0.27.0; ..."."""
        h, refs = self.hang, ", ".join(self.hang.refs)
        if self.status == "fixed":
            return f"known hang: not {h.title} fixed by vLLM {refs} in {h.fixed_in}: {self.advice}"
        if h.fixed_in is not None:
            return f"known hang: {h.title} fixed by vLLM {refs} in {h.fixed_in}; {self.advice}"
        return f"known hang: {h.title} (vLLM {refs}): {self.advice}"

    def to_json(self) -> dict[str, Any]:
        h = self.hang
        return {"id": h.id, "title": h.title, "sources": list(h.sources), "cause": h.cause, "fixed_in": h.fixed_in,
                "engine_version": self.version or None, "status": self.status, "advice": self.advice,
                "seen": list(self.seen), "said": self.clause}


def _engine(f: Findings) -> ProcessFinding | None:
    return next((p for p in f.processes if p.process.role == Role.ENGINE_CORE and p.explanation), None)


def _cls(p: ProcessFinding) -> Cls | None:
    return p.explanation.cls if p.explanation else None


def _gone(p: ProcessFinding, capture: Capture | None) -> bool:
    dumps = capture.dumps_of(p.process) if capture else []
    return p.state[:1] in ("Z", "X") or any(d.failure is Failure.GONE for d in dumps)


def _broadcast(rings: Sequence[Ring]) -> list[Ring]:
    """The rings read that EngineCore writes (its step to the workers), or whose writer was not named."""
    return [r for r in rings if r.ok and (not r.writer or "EngineCore" in r.writer)]


def _unread(rings: Sequence[Ring]) -> str:
    """ "block 3 of psm_ab12 written, unread by Worker_TP0" for the first such block, or ""."""
    for r in rings:
        for b in r.unread():
            who = ", ".join(r.reader_name(i) for i in b.unread_by())
            return f"block {b.index} of {r.segment} written, unread by {who}"
    return ""


def _pending(f: Findings) -> bool:
    return f.hypothesis.status is Status.SUPPORTED or (
        f.page is not None and ((f.page.running or 0) > 0 or (f.page.waiting or 0) > 0))


_PARKED = (StuckKind.PARKED, StuckKind.LOST_WAKEUP)  # the stacks parked; LOST_WAKEUP: the ring's unread block too


def _lost_wakeup(f: Findings, capture: Capture | None) -> tuple[str, ...] | None:
    engine = _engine(f)
    workers = [p for p in f.processes if p.process.role == Role.WORKER]
    local = [w for w in workers if w.process.node == "local"]
    if (f.decision is not Decision.STUCK or f.stuck_kind not in _PARKED or engine is None or not local
            or _cls(engine) not in (Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING) or not _pending(f)):
        return None
    if any(_cls(w) is not Cls.IDLE_READER_WAIT or _gone(w, capture) for w in local):
        return None
    if any(_cls(w) not in (Cls.IDLE_READER_WAIT, Cls.IN_COLLECTIVE) for w in workers):
        return None  # a rank on another node that is not waiting (stopped, in the model, unread): it is the cause
    seen = [f"work pending ({f.page})" if f.page is not None else "work pending",
            f"EngineCore {_cls(engine)}",
            f"{', '.join(w.explanation.name for w in local if w.explanation)} parked in the reader (idle_reader_wait)",
            "nothing moved between captures"]
    rings = _broadcast(capture.rings if capture is not None else ())
    if rings:
        unread = _unread(rings)
        if not unread:
            return None  # the ring was read and every written block was taken: no wake-up was lost
        seen.append(unread)
    else:
        seen.append("the broadcast ring was not read: the stacks alone")
    return tuple(seen)


def _negative_timeout(f: Findings) -> tuple[str, ...] | None:
    engine = _engine(f)
    if engine is None or engine.explanation is None or _cls(engine) is not Cls.ENGINE_WAITING_WORKERS:
        return None
    names = [fr.function.rsplit(".", 1)[-1] for fr in engine.explanation.frames]
    recv = any(fr.function.endswith("MessageQueue.recv") for fr in engine.explanation.frames)
    if not (recv and "get_response" in names and "poll" in names):
        return None
    return ("EngineCore in get_response < MessageQueue.recv < Socket.poll (the timeout's value is not in the stacks)",)


def _writer_after_death(f: Findings, capture: Capture | None) -> tuple[str, ...] | None:
    engine = _engine(f)
    dead = [p for p in f.processes if p.process.role == Role.WORKER and _gone(p, capture)]
    if engine is None or _cls(engine) is not Cls.WRITER_BLOCKED_FULL_RING or not dead:
        return None
    return ("EngineCore writer_blocked_full_ring (acquire_write)",
            f"{', '.join(p.process.label for p in dead)} gone (its process exited)")


def _log_lines(f: Findings, log_tail: str) -> tuple[str, ...] | None:
    engine = _engine(f)
    if engine is not None and _cls(engine) is not Cls.ENGINE_WAITING_WORKERS:
        return None  # EngineCore is not waiting on a reply now: the lines are of another time (a compile, a load)
    if any(_cls(p) is Cls.STOPPED for p in f.processes):
        return None  # a rank stopped from outside (SIGSTOP, a debugger): the wait is explained, no vLLM bug
    seen = []
    if n := log_tail.count(RING_LINE):
        seen.append(f'"{RING_LINE}" {n} time{"s" if n > 1 else ""} in the log tail: EngineCore waited over 60 s '
                    "for a worker's reply")
    if calls := sorted(set(_RPC_TIMEOUT.findall(log_tail))):
        seen.append(f"RPC call to {', '.join(calls)} timed out, in the log tail")
    return tuple(seen) or None


def match(f: Findings, capture: Capture | None = None, log_tail: str = "", vllm: str = "") -> tuple[Match, ...]:
    """Every known hang this evidence shows, the most specific first: ``capture`` (its rings, the ranks gone),
    ``log_tail`` (the engine's log, every node's), ``vllm`` the engine's version as read ("" when not)."""
    found = [(LOST_WAKEUP, _lost_wakeup(f, capture)), (NEGATIVE_RPC_TIMEOUT, _negative_timeout(f)),
             (WRITER_AFTER_DEATH, _writer_after_death(f, capture)), (WORKER_HUNG_IN_STEP, _log_lines(f, log_tail))]
    if not vllm.strip() and capture is not None:  # the ring reader's own reading of the version, if it has one
        vllm = next((r.version for r in capture.rings if r.version), "")
    return tuple(Match(h, seen, vllm.strip()) for h, seen in found if seen)


def with_clause(headline: str, matches: Sequence[Match]) -> str:
    """The headline with the first match's clause appended (once); unchanged with none."""
    if not matches or matches[0].clause in headline:
        return headline
    return f"{headline}; {matches[0].clause}" if headline else matches[0].clause


def manifest_entry(matches: Sequence[Match]) -> dict[str, Any] | None:
    """The manifest's ``known_hang``: the first match, the others' ids under ``also``; None with no match."""
    if not matches:
        return None
    return {**matches[0].to_json(), "also": [m.to_json() for m in matches[1:]]}


def said(entry: dict[str, Any] | None) -> str:
    """One line for a report, from a manifest's ``known_hang`` (None: no match)."""
    if not isinstance(entry, dict) or not entry.get("said"):
        return NO_MATCH
    text, src = str(entry["said"]).removeprefix("known hang: "), "; ".join(map(str, entry.get("sources") or []))
    return f"{text} (sources: {src})" if src else text
