"""What goes between the watchdog and its agent on another node. Pure: parsing and (de)serialising only.

A call is one ssh session through the node's shared connection. The verb is the ssh command itself (what the
forced command sees in ``SSH_ORIGINAL_COMMAND``), its arguments a JSON object on stdin, the answer one JSON object
on stdout (``liveness`` answers one JSON line every interval until the session ends). Anything but a bare known
verb is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from watchdog.core.processes import Capture, Dump, EngineProcess, Failure, ProcFacts
from watchdog.core.ring import Ring, RingBlock
from watchdog.core.roles import Role

PROTOCOL = 1
VERBS = ("version", "list", "stacks", "context", "liveness", "run", "shm", "ring")
MAX_REQUEST_BYTES = 64 * 1024  # what the agent reads of a request, at most
# /proc state letter -> rank state
RANK_STATES = {"R": "running", "S": "running", "D": "running", "I": "running", "T": "stopped", "t": "stopped",
               "Z": "zombie", "X": "gone"}


class ProtocolError(ValueError):
    """A request or an answer that is not what the protocol allows; the message says what."""


class LogRefused(ProtocolError):
    """The head asked for a log this node's config does not let it read."""


MAX_DEPTH = 16  # the deepest a request (or an answer) may nest; ours nest 5 at most


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # one JSON string, its escapes included
_BRACKET = re.compile(r"[\[\]{}]")


def depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (strings skipped), without recursion. The strings go
    first (one regex); a quote left is a string never closed, and all after it is inside it."""
    bare = _STRING.sub("", text).split('"', 1)[0]
    deepest = level = 0
    for m in _BRACKET.finditer(bare):
        if m.group() in "[{":
            level += 1
            deepest = max(deepest, level)
        else:
            level -= 1
    return deepest


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not a number this protocol takes")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ProtocolError(f"key {k[:60]!r} given twice")
        out[k] = v
    return out


def load_json(raw: bytes | str, what: str = "request", max_depth: int = MAX_DEPTH) -> Any:
    """One JSON value; ProtocolError for anything else (invalid, too deep, NaN, a key twice)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{what} is not UTF-8: {e}") from None
    if depth(text) > max_depth:
        raise ProtocolError(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_pairs)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"{what} is not JSON: {str(e)[:200]}") from None


def parse_args(raw: bytes) -> dict[str, Any]:
    """The request's JSON object (empty input: ``{}``)."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request over {MAX_REQUEST_BYTES} bytes")
    if not raw.strip():
        return {}
    value = load_json(raw)
    if not isinstance(value, dict):
        raise ProtocolError("request must be a JSON object")
    return value


def parse_verb(command: str | None) -> str:
    """The verb of ``SSH_ORIGINAL_COMMAND``: exactly one known word, nothing else."""
    if command is None or not command.strip():
        raise ProtocolError("no command: this key only runs the watchdog agent's verbs: " + ", ".join(VERBS))
    words = command.split()
    if len(words) != 1 or words[0] not in VERBS:
        raise ProtocolError(f"refused command {command[:120]!r}: this key only runs the watchdog agent's verbs: "
                            + ", ".join(VERBS))
    return words[0]


def parse_answer(raw: bytes) -> dict[str, Any]:
    """One answer: a JSON object with ``ok``; a refusal raises with the agent's own message (cleaned, capped)."""
    try:
        value = load_json(raw, "the agent's answer")
    except ProtocolError as e:
        raise ProtocolError(f"{e}: {raw[:200]!r}") from None
    if not isinstance(value, dict) or "ok" not in value:
        raise ProtocolError(f"the agent's answer is not a protocol object: {raw[:200]!r}")
    if value["ok"] is not True:
        raise ProtocolError(clean(value.get("error") or "refused, no reason given", 500))
    return value


def clean(value: object, limit: int = 512, keep: str = "") -> str:
    """A string from the other side, fit to print on one line (``keep="\\n\\t"``: lines kept): control characters
    (terminal escapes included) replaced, length capped."""
    text = (value if isinstance(value, str) else str(value))[:limit]
    if text.isprintable():  # no control character in it (C0, DEL and C1 are all unprintable): most text, at once
        return text
    return "".join("\ufffd" if (ord(c) < 32 or 127 <= ord(c) < 160) and c not in keep else c for c in text)


def number(value: object, what: str) -> float:
    """A finite number from the other side (never a bool, a string, NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolError(f"{what} is not a finite number: {clean(repr(value), 60)}")
    return float(value)


def pid_of(value: object) -> int:
    """A pid from the other side: a whole number 1 .. 2**22 - 1 (the kernel's highest pid_max is 2**22)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 22:
        raise ProtocolError(f"not a pid: {clean(repr(value), 60)}")
    return value


# ---------------------------------------------------------------- which log the head may read there

LOG_KINDS = ("journal_unit", "docker_container", "log_file")


def log_wanted(journal_unit: str = "", docker_container: str = "", log_file: str = "") -> dict[str, str]:
    """The head's ``log`` argument for ``context``: its ``[[nodes]]`` entry's one source, or {} (none named)."""
    given = {"journal_unit": journal_unit, "docker_container": docker_container, "log_file": log_file}
    return {k: v for k, v in given.items() if v}


def choose_log(wanted: object, own: dict[str, str]) -> tuple[str, str]:
    """The one log the agent reads: (kind, name), or ("", "") for none.

    The head's ``[[nodes]]`` entry says which log it wants; the node's own config names the one log it lets the head
    read (``own``: kind -> name, empty values ignored). The head's choice is read only if it is exactly the node's;
    a head that names none gets the node's own. Another log raises `LogRefused`; a malformed ``log``, `ProtocolError`.
    """
    if wanted is None:
        wanted = {}
    if not isinstance(wanted, dict) or len(wanted) > 1 or any(
            k not in LOG_KINDS or not isinstance(v, str) or not v for k, v in wanted.items()):
        raise ProtocolError("log must be an object with one of " + ", ".join(LOG_KINDS) + " (a non-empty string)")
    mine = [(k, v) for k, v in own.items() if v]
    if not wanted:
        return mine[0] if mine else ("", "")
    ((kind, name),) = wanted.items()
    if not mine:
        raise LogRefused(f"log refused: the head asks for {kind} {name!r}, but this node's config allows no log "
                            f"(set one of {', '.join(LOG_KINDS)} in its agent config)")
    if (kind, name) != mine[0]:
        raise LogRefused(f"log refused: the head asks for {kind} {name!r}, but this node's config allows only "
                            f"{mine[0][0]} {mine[0][1]!r}")
    return kind, name


# ---------------------------------------------------------------- evidence across the wire

def process_to_json(p: EngineProcess) -> dict[str, Any]:
    return {"pid": p.pid, "role": p.role.value, "title": p.title, "ranks": p.ranks, "ppid": p.ppid}


def _boolean(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{what} is not true or false")
    return value


def _ranks(value: object) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 8 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 16 for v in value.values()):
        raise ProtocolError("ranks must map at most 8 names to whole numbers 0..65535")
    return {clean(k, 16): v for k, v in value.items()}


def process_from_json(d: object, node: str) -> EngineProcess:
    """A process of ``node``, with its pid there. Every field checked: a pid in range, a known role, ranks small whole
    numbers, the title one printable line."""
    if not isinstance(d, dict):
        raise ProtocolError("bad process in the agent's answer: not an object")
    try:
        pid = pid_of(d.get("pid"))
        role = Role(str(d.get("role")))
        ppid = d.get("ppid")
        if ppid is not None and ppid != 0:  # 0: its parent is outside the node's PID namespace
            ppid = pid_of(ppid)
        title = clean(d.get("title") or "", 256)  # named with its node, so the summary and the culprit say where
        return EngineProcess(pid, role, f"{title} on node {node}" if title else "", _ranks(d.get("ranks")), ppid,
                             node=node)
    except ValueError as e:  # ProtocolError, and Role's own
        raise ProtocolError(f"bad process in the agent's answer: {e}") from None


def dump_to_json(d: Dump) -> dict[str, Any]:
    facts = None if d.facts is None else {"state": d.facts.state, "wchan": d.facts.wchan,
                                          "cpu_seconds": d.facts.cpu_seconds, "threads": d.facts.threads}
    return {"pid": d.pid, "t": d.t, "ok": d.ok, "output": d.output, "error": d.error, "nonblocking": d.nonblocking,
            "facts": facts, "seconds": d.seconds, "failure": d.failure.value if d.failure else None,
            "quiet": list(d.quiet) if d.quiet else None}


def dump_from_json(d: object, pid: int, t_offset: float) -> Dump:
    """A remote dump of ``pid`` (on its node); its time moved onto our clock by ``t_offset``. Every field checked."""
    if not isinstance(d, dict):
        raise ProtocolError("bad dump in the agent's answer: not an object")
    try:
        f = d.get("facts")
        facts = None
        if f is not None:
            if not isinstance(f, dict):
                raise ProtocolError("facts is not an object")
            threads = f.get("threads")
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
                raise ProtocolError("facts.threads is not a count")
            facts = ProcFacts(clean(f.get("state"), 2), clean(f.get("wchan"), 128),
                              number(f.get("cpu_seconds"), "facts.cpu_seconds"), threads)
        q = d.get("quiet")
        if q is not None and (not isinstance(q, list) or len(q) != 2):
            raise ProtocolError("quiet is not a pair")
        output = d.get("output")
        if not isinstance(output, str):
            raise ProtocolError("output is not a string")
        return Dump(pid, number(d.get("t"), "t") + t_offset, _boolean(d.get("ok"), "ok"), output,
                    clean(d.get("error", ""), 1000), _boolean(d.get("nonblocking", False), "nonblocking"), facts,
                    number(d.get("seconds", 0.0), "seconds"), Failure(d["failure"]) if d.get("failure") else None,
                    None if q is None else (number(q[0], "quiet"), number(q[1], "quiet")))
    except ValueError as e:  # ProtocolError, and Failure's own
        raise ProtocolError(f"bad dump in the agent's answer: {e}") from None


def capture_to_json(c: Capture) -> dict[str, Any]:
    return {"processes": [process_to_json(p) for p in c.processes],
            "rounds": [[dump_to_json(d) for d in r.values()] for r in c.rounds],
            "problems": [str(p) for p in c.problems], "options": c.options}


MAX_RINGS, MAX_RING_BLOCKS, MAX_RING_READERS = 64, 64, 1024


def _count(value: object, what: str, high: int = 1 << 40) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise ProtocolError(f"{what} is not a count")
    return value


def ring_from_json(d: object, node: str) -> Ring:
    """One ring of ``node``'s ``ring`` answer (`watchdog.evidence.explain.ring_said.ring_to_dict`), every field
    checked: bounded lists, flags true or false, one read flag per reader."""
    if not isinstance(d, dict):
        raise ProtocolError("bad ring in the agent's answer: not an object")
    readers, blocks = d.get("readers") or [], d.get("blocks") or []
    if not isinstance(readers, list) or len(readers) > MAX_RING_READERS or not isinstance(blocks, list) \
            or len(blocks) > MAX_RING_BLOCKS:
        raise ProtocolError("bad ring in the agent's answer: readers or blocks not a bounded list")
    out = []
    for b in blocks:
        read = b.get("read") if isinstance(b, dict) else None
        if not isinstance(read, list) or len(read) != len(readers):
            raise ProtocolError("bad ring block in the agent's answer: not one read flag per reader")
        out.append(RingBlock(_count(b.get("index"), "block index", MAX_RING_BLOCKS),
                             _boolean(b.get("written"), "written"), tuple(_boolean(r, "read") for r in read)))
    return Ring(clean(d.get("segment") or "", 128), node, clean(d.get("writer") or "", 256),
                tuple(clean(r, 256) for r in readers), clean(d.get("layout") or "", 64),
                clean(d.get("version") or "", 64), _count(d.get("max_chunks", 0), "max_chunks"),
                _count(d.get("max_chunk_bytes", 0), "max_chunk_bytes"), tuple(out),
                clean(d.get("error") or "", 1000), number(d.get("t", 0.0), "t"))


@dataclass(frozen=True, slots=True)
class RankState:
    """One engine process on a node as its liveness report saw it."""

    pid: int
    title: str
    role: str
    state: str  # running | stopped | zombie | gone


RANK_STATE_NAMES = frozenset(RANK_STATES.values())
ROLE_NAMES = frozenset(x.value for x in Role)


def ranks_from_report(report: object) -> tuple[RankState, ...]:
    """The ranks of one liveness report, every field checked (a pid, a title line, a known role and state)."""
    ranks = report.get("ranks") if isinstance(report, dict) else None
    if not isinstance(ranks, list) or len(ranks) > 4096:
        raise ProtocolError("a liveness report without ranks")
    out = []
    for r in ranks:
        if not isinstance(r, dict):
            raise ProtocolError("bad rank in a liveness report: not an object")
        role, state = r.get("role"), r.get("state")
        if role not in ROLE_NAMES or state not in RANK_STATE_NAMES:
            raise ProtocolError(f"bad rank in a liveness report: role {clean(role, 40)!r}, state {clean(state, 40)!r}")
        out.append(RankState(pid_of(r.get("pid")), clean(r.get("title") or "", 256), str(role), str(state)))
    return tuple(out)
