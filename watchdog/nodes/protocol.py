"""What goes between the watchdog and its agent on another node. Pure: parsing and (de)serialising only.

A call is one ssh session through the node's shared connection. The verb is the ssh command itself (what the
forced command sees in ``SSH_ORIGINAL_COMMAND``), its arguments a JSON object on stdin, the answer one JSON object
on stdout (``liveness`` answers one JSON line every interval until the session ends). Anything but a bare known
verb is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from watchdog.core.processes import Capture, Dump, EngineProcess, Failure, ProcFacts
from watchdog.core.roles import Role

PROTOCOL = 1
VERBS = ("version", "list", "stacks", "context", "liveness", "run", "shm")
MAX_REQUEST_BYTES = 64 * 1024  # what the agent reads of a request, at most
# /proc state letter -> rank state
RANK_STATES = {"R": "running", "S": "running", "D": "running", "I": "running", "T": "stopped", "t": "stopped",
               "Z": "zombie", "X": "gone"}


class ProtocolError(ValueError):
    """A request or an answer that is not what the protocol allows; the message says what."""


class LogRefused(ProtocolError):
    """The head asked for a log this node's config does not let it read."""


def parse_verb(command: str | None) -> str:
    """The verb of ``SSH_ORIGINAL_COMMAND``: exactly one known word, nothing else."""
    if command is None or not command.strip():
        raise ProtocolError("no command: this key only runs the watchdog agent's verbs: " + ", ".join(VERBS))
    words = command.split()
    if len(words) != 1 or words[0] not in VERBS:
        raise ProtocolError(f"refused command {command[:120]!r}: this key only runs the watchdog agent's verbs: "
                            + ", ".join(VERBS))
    return words[0]


def parse_args(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request over {MAX_REQUEST_BYTES} bytes")
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"request is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ProtocolError("request must be a JSON object")
    return value


def parse_answer(raw: bytes) -> dict[str, Any]:
    """One answer: a JSON object with ``ok``; a refusal raises with the agent's own message."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the agent's answer is not JSON ({e}): {raw[:200]!r}") from None
    if not isinstance(value, dict) or "ok" not in value:
        raise ProtocolError(f"the agent's answer is not a protocol object: {raw[:200]!r}")
    if not value["ok"]:
        raise ProtocolError(str(value.get("error") or "refused, no reason given"))
    return value


def want_list(args: dict[str, Any], key: str, kind: type) -> list[Any]:
    value = args.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise ProtocolError(f"{key} must be a list of {kind.__name__}")
    return value


def want_number(args: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ProtocolError(f"{key} must be a number in {low:g}..{high:g}")
    return float(value)


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


def process_from_json(d: dict[str, Any], node: str, key: int | None = None) -> EngineProcess:
    """A process of ``node``; ``key`` replaces its pid as the capture's key (pids of two nodes may collide)."""
    try:
        pid = int(d["pid"])
        ranks = {str(k): int(v) for k, v in dict(d.get("ranks") or {}).items()}
        title = str(d.get("title", ""))  # named with its node, so the summary and the culprit say where it runs
        return EngineProcess(key if key is not None else pid, Role(d["role"]), f"{title} on node {node}" if title
                             else "", ranks, d.get("ppid"), node=node, node_pid=pid)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad process in the agent's answer: {e}") from None


def dump_to_json(d: Dump) -> dict[str, Any]:
    facts = None if d.facts is None else {"state": d.facts.state, "wchan": d.facts.wchan,
                                          "cpu_seconds": d.facts.cpu_seconds, "threads": d.facts.threads}
    return {"pid": d.pid, "t": d.t, "ok": d.ok, "output": d.output, "error": d.error, "nonblocking": d.nonblocking,
            "facts": facts, "seconds": d.seconds, "failure": d.failure.value if d.failure else None,
            "quiet": list(d.quiet) if d.quiet else None}


def dump_from_json(d: dict[str, Any], pid: int, t_offset: float) -> Dump:
    """A remote dump keyed ``pid``; its time moved onto our clock by ``t_offset``."""
    try:
        f = d.get("facts")
        facts = None if f is None else ProcFacts(str(f["state"]), str(f["wchan"]), float(f["cpu_seconds"]),
                                                 int(f["threads"]))
        q = d.get("quiet")
        return Dump(pid, float(d["t"]) + t_offset, bool(d["ok"]), str(d["output"]), str(d.get("error", "")),
                    bool(d.get("nonblocking")), facts, float(d.get("seconds", 0.0)),
                    Failure(d["failure"]) if d.get("failure") else None,
                    None if q is None else (float(q[0]), float(q[1])))
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad dump in the agent's answer: {e}") from None


def capture_to_json(c: Capture) -> dict[str, Any]:
    return {"processes": [process_to_json(p) for p in c.processes],
            "rounds": [[dump_to_json(d) for d in r.values()] for r in c.rounds],
            "problems": list(c.problems), "options": c.options}


@dataclass(frozen=True, slots=True)
class RankState:
    """One engine process on a node as its liveness report saw it."""

    pid: int
    title: str
    role: str
    state: str  # running | stopped | zombie | gone


def ranks_from_report(report: dict[str, Any]) -> tuple[RankState, ...]:
    ranks = report.get("ranks")
    if not isinstance(ranks, list):
        raise ProtocolError("a liveness report without ranks")
    try:
        return tuple(RankState(int(r["pid"]), str(r["title"]), str(r["role"]), str(r["state"])) for r in ranks)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad rank in a liveness report: {e}") from None
