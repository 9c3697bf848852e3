"""The watchdog's agent on another node: the forced command its SSH key is bound to.

``command="/opt/engine-watchdog/.venv/bin/python -m watchdog.nodes.agent --config /etc/engine-watchdog/agent.toml"``
in ``authorized_keys``: whatever the client asks, sshd runs this, with the request in ``SSH_ORIGINAL_COMMAND``.
It accepts one bare verb (`protocol.VERBS`), reads the arguments as JSON on stdin (capped in bytes, nesting and
time: ``request_timeout``), checks every argument (`arguments.check_args`: known keys only, strict types, ranges),
answers one JSON object on stdout. It runs only what this node's own config allows, on the processes it takes
for the engine's (`identity`); anything else is refused, with the reason. Every session is in the audit log
(`audit`: JSON lines): its start, then what it did or why it was refused. No request, however malformed, gets
anything but one JSON answer. It listens on nothing: sshd is the only door. docs/threat-model.md says what a
caller can do with each verb.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import time
from types import FrameType
from typing import IO, Any

from watchdog import __version__
from watchdog.config.load import ConfigError
from watchdog.core.processes import EngineProcess
from watchdog.evidence.collect.capture import Capturer, find_pyspy
from watchdog.evidence.collect.context import LogSource, installed_versions, log_tail
from watchdog.evidence.collect.discover import discover
from watchdog.evidence.collect.ring import read_engine_rings
from watchdog.evidence.explain.ring_said import ring_to_dict
from watchdog.host.ptrace import attach_check
from watchdog.host.run import LocalRunner
from watchdog.nodes import audit
from watchdog.nodes.agent_config import DEFAULT_PATH, AgentConfig, load_agent_config
from watchdog.nodes.arguments import check_args
from watchdog.nodes.identity import EngineIdentity
from watchdog.nodes.protocol import (
    MAX_REQUEST_BYTES,
    PROTOCOL,
    LogRefused,
    ProtocolError,
    capture_to_json,
    choose_log,
    clean,
    parse_args,
    parse_verb,
    process_to_json,
)
from watchdog.nodes.ranks import RankTracker
from watchdog.nodes.shm import remove_stale, shm_segments

log = logging.getLogger("watchdog.agent")
# the `ignored` records of one session: each goes to stderr too (sshd hands it to the head), and any local user can
# title processes, as many and as long as they like; so the first few are recorded, their titles capped, the rest
# counted
MAX_IGNORED_RECORDS = 16
MAX_TITLE = 256


class Refused(Exception):
    """A request this node does not run; the message goes back to the head and into the audit log."""


class Ended(BaseException):
    """The session was ended by a signal (sshd, an operator). A BaseException, like KeyboardInterrupt: a broad
    ``except Exception`` on the way (a log handler's, a probe's) cannot swallow a stop."""


def _shm_names(shm_dir: str) -> list[str]:
    try:
        return [s.name for s in shm_segments(shm_dir)]
    except OSError:  # the context goes on without them; the `shm` verb says why
        return []


class Agent:
    def __init__(self, cfg: AgentConfig, out: IO[str] | None = None) -> None:
        self.cfg = cfg
        self.out = out if out is not None else sys.stdout
        self.pyspy = find_pyspy(cfg.pyspy)
        self.identity = EngineIdentity(cfg.identity())
        self.ignored: dict[int, str] = {}  # titled processes not taken for the engine's: pid -> why
        self.done: dict[str, Any] = {}  # what the verb did, for its audit record

    def processes(self) -> list[EngineProcess]:
        """This node's engine processes: the right title and the identity this node's config asks for."""
        kept = []
        for p in discover(None, self.cfg.process_prefix, self.cfg.title_filter, container=self.cfg.docker_container):
            why = self.identity.check(p.pid, p.title)
            if not why:
                kept.append(p)
            elif p.pid not in self.ignored:  # said once per session, and only for the first few
                self.ignored[p.pid] = why
                if len(self.ignored) <= MAX_IGNORED_RECORDS:
                    audit.record(log, "ignored", logging.WARNING, process=p.pid, title=clean(p.title, MAX_TITLE),
                                 reason=clean(why, 1000))
                elif len(self.ignored) == MAX_IGNORED_RECORDS + 1:
                    audit.record(log, "ignored, more", logging.WARNING, reason=(
                        f"more than {MAX_IGNORED_RECORDS} titled processes not taken for the engine's: the rest are "
                        "counted (in the session's last record), not recorded each"))
        return kept

    def handle(self, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` already checked (`arguments.check_args`)."""
        return dict(getattr(self, f"verb_{verb}")(args))

    def verb_version(self, args: dict[str, Any]) -> dict[str, Any]:
        procs = self.processes()
        allowed, why = attach_check()
        return {"version": __version__, "protocol": PROTOCOL, "hostname": socket.gethostname(), "time": time.time(),
                "pyspy": self.pyspy, "ptrace_allowed": allowed, "ptrace": why,
                "ranks": [p.title for p in procs if p.ranks], "processes": len(procs), "ignored": len(self.ignored),
                "identity": self.identity.rule.say()}

    def verb_list(self, args: dict[str, Any]) -> dict[str, Any]:
        procs = self.processes()
        self.done = {"processes": [p.pid for p in procs]}
        return {"time": time.time(), "processes": [process_to_json(p) for p in procs],
                "ignored": [{"pid": pid, "reason": why} for pid, why in self.ignored.items()]}

    def verb_stacks(self, args: dict[str, Any]) -> dict[str, Any]:
        wanted = set(args["pids"])
        timeout = args["timeout"] if args["timeout"] is not None else self.cfg.capture_timeout
        found = self.processes()
        if wanted - {p.pid for p in found}:  # py-spy runs on this node's engine processes only
            raise Refused(f"not engine processes here: {sorted(wanted - {p.pid for p in found})}")
        chosen = [p for p in found if p.pid in wanted] if wanted else found
        native, with_locals, notes = args["native"], args["locals"], []
        for option, asked, allowed in (("native", native, self.cfg.allow_native),
                                       ("locals", with_locals, self.cfg.allow_locals)):
            if asked and not allowed:
                notes.append(f"--{option} is not allowed by this node's config ({self.cfg.source}): stacks taken "
                             "without it")
                audit.record(log, "option refused", logging.WARNING, option=option, reason=notes[-1])
        native, with_locals = native and self.cfg.allow_native, with_locals and self.cfg.allow_locals
        self.done = {"pids": [p.pid for p in chosen], "rounds": args["rounds"], "native": native,
                     "locals": with_locals}
        capturer = Capturer(self.pyspy, timeout, native, with_locals)
        t0 = time.time()
        capture = capturer.capture(chosen, args["rounds"], args["gap"])
        got = capture_to_json(capture)
        got["problems"] = [*got["problems"], *notes]
        # our dumps carry monotonic times; the head moves them onto its clock with this pair
        return {"capture": got, "time": t0, "monotonic": capturer.clock(), "wall": time.time()}

    def verb_context(self, args: dict[str, Any]) -> dict[str, Any]:
        """Log tail, versions, /dev/shm. The log is the one the head's entry names if this node's config allows
        exactly that one (else refused: said in the answer and the audit log), or this node's own when it names none."""
        own = {"journal_unit": self.cfg.journal_unit, "docker_container": self.cfg.docker_container,
               "log_file": self.cfg.log_file}
        refused = ""
        try:
            kind, name = choose_log(args["log"], own)
        except LogRefused as e:
            audit.record(log, "log refused", logging.WARNING, asked=args["log"], reason=str(e))
            kind, name, refused = "", "", str(e)
        pick = {k: name if kind == k else "" for k in ("log_file", "journal_unit", "docker_container")}
        src = LogSource(pick["log_file"], pick["journal_unit"], pick["docker_container"], args["lines"])
        tail, where, problem = log_tail(src)
        self.done = {"log": where, "lines": args["lines"], "log_problem": refused or problem}
        pids = [p.pid for p in self.processes() if p.ranks]
        ours = {"watchdog": __version__, "python": sys.version.split()[0]}
        return {"time": time.time(), "log_tail": tail[-512 * 1024:], "log_source": where,
                "problem": refused or problem, "log_refused": refused,
                "versions": installed_versions(pids, self.pyspy, versions=ours), "shm": _shm_names(self.cfg.shm_dir)}

    def verb_liveness(self, args: dict[str, Any]) -> dict[str, Any]:
        interval = args["interval"]
        tracker = RankTracker(self.processes, rediscover_every=max(30.0, interval * 10))
        seq = 0
        while True:  # until the head ends the session: the write then fails
            report = {"ok": True, "seq": seq, "time": time.time(), "ranks": tracker.poll()}
            self.out.write(json.dumps(report) + "\n")
            self.out.flush()
            seq += 1
            time.sleep(interval)

    def verb_run(self, args: dict[str, Any]) -> dict[str, Any]:
        asked = args["argv"]
        permitted = self.cfg.permits(asked)
        if permitted is None:
            raise Refused(f"not allowed by this node's config ({self.cfg.source}): {json.dumps(list(asked))[:300]}")
        argv, limit = permitted
        timeout = min(args["timeout"], limit)
        audit.record(log, "running", argv=list(argv), asked=list(asked) if argv != asked else None,
                     timeout=timeout)
        r = LocalRunner()(argv, timeout)
        self.done = {"argv": list(r.argv), "rc": r.rc, "timed_out": r.timed_out, "duration": round(r.duration, 3)}
        return {"argv": list(r.argv), "rc": r.rc, "duration": r.duration, "timed_out": r.timed_out,
                "output": r.output, "error": r.error}

    def verb_ring(self, args: dict[str, Any]) -> dict[str, Any]:
        """The broadcast ring's flags of this node's engine processes: read-only (O_RDONLY, one pread of the flag
        bytes, never mapped), bounded (`watchdog.evidence.collect.ring`); every failure is said in the ring."""
        rings = read_engine_rings(self.processes(), time.monotonic())
        self.done = {"rings": [r.segment for r in rings], "errors": [r.error[:200] for r in rings if r.error]}
        return {"time": time.time(), "monotonic": time.monotonic(), "rings": [ring_to_dict(r) for r in rings]}

    def verb_shm(self, args: dict[str, Any]) -> dict[str, Any]:
        remove = args["remove"]
        if remove and not self.cfg.remove_shm:
            raise Refused(f"removing /dev/shm segments is not allowed by this node's config ({self.cfg.source})")
        segs = shm_segments(self.cfg.shm_dir)
        removed, failed = remove_stale(segs) if remove else ([], [])
        for s in removed:
            audit.record(log, "removed", segment=s.name, path=s.path, bytes=s.size)
        for s, why in failed:
            audit.record(log, "not removed", logging.WARNING, segment=s.name, path=s.path, reason=why)
        gone = {s.name for s in removed}
        self.done = {"remove": remove, "removed": sorted(gone), "bytes_removed": sum(s.size for s in removed)}
        return {"segments": [{"name": s.name, "bytes": s.size, "in_use": not s.stale} for s in segs
                             if s.name not in gone],
                "removed": sorted(gone), "stale_bytes": sum(s.size for s in segs if s.stale and s.name not in gone)}


def read_request(fd: int, limit: int, within: float) -> bytes:
    """Stdin until it closes: at most ``limit`` bytes, within ``within`` seconds; else ProtocolError."""
    deadline = time.monotonic() + within
    buf = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"no complete request within {within:g}s ({len(buf)} bytes came): refused")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            raise ProtocolError(f"request over {limit} bytes")


def _answer(out: IO[str], value: dict[str, Any]) -> None:
    try:
        out.write(json.dumps(value) + "\n")
        out.flush()
    except (OSError, ValueError):  # the head is gone: nobody to answer
        pass


def _quiet(out: IO[str]) -> None:
    """Nothing more to the head (its end is gone): what is still buffered is dropped, not an error at exit."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())


def _ended(signum: int, frame: FrameType | None) -> None:
    raise Ended(f"ended by {signal.Signals(signum).name}")


def serve(cfg: AgentConfig, command: str | None, stdin: int = 0, out: IO[str] | None = None,
          audit_problem: str = "") -> int:
    """One session: the verb, its request, its answer; every outcome in the audit log. The exit status: 0 done,
    2 refused, 70 the agent failed (said in the answer, never a traceback instead of one). ``audit_problem``: why
    the audit log file cannot be written; every answer then carries it (``audit_problem``), so the head says so
    (`watchdog nodes`) rather than the records going to stderr only."""
    out = out if out is not None else sys.stdout
    said = {"audit_problem": audit_problem} if audit_problem else {}
    started = time.monotonic()
    audit.record(log, "session", command=command if command is None else command[:1000])
    verb = ""
    try:
        verb = parse_verb(command)
        args = check_args(verb, parse_args(read_request(stdin, MAX_REQUEST_BYTES, cfg.request_timeout)))
        agent = Agent(cfg, out)
        answer = agent.handle(verb, args)
        many = {"ignored": len(agent.ignored)} if len(agent.ignored) > MAX_IGNORED_RECORDS else {}
        audit.record(log, "done", verb=verb, seconds=round(time.monotonic() - started, 3), **agent.done, **many)
    except (ProtocolError, Refused) as e:
        audit.record(log, "refused", logging.WARNING, verb=verb or None, reason=str(e),
                     seconds=round(time.monotonic() - started, 3))
        _answer(out, {"ok": False, "error": str(e), **said})
        return 2
    except (BrokenPipeError, Ended) as e:  # the head ended a liveness stream; sshd or an operator ended us
        _quiet(out)
        audit.record(log, "ended", verb=verb or None, reason=str(e) or "the head closed the session",
                     seconds=round(time.monotonic() - started, 3))
        return 0
    except Exception as e:  # the agent's own failure: one JSON answer still, and the record says what
        audit.record(log, "failed", logging.ERROR, verb=verb or None, reason=f"{type(e).__name__}: {e}"[:1000],
                     seconds=round(time.monotonic() - started, 3))
        _answer(out, {"ok": False, "error": f"the agent failed: {type(e).__name__}: {str(e)[:300]}", **said})
        return 70
    _answer(out, {"ok": True, **answer, **said})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="watchdog-agent", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_PATH)
    a = p.parse_args(argv)
    command = os.environ.get("SSH_ORIGINAL_COMMAND")
    client = os.environ.get("SSH_CLIENT", "?").split(" ")[0]
    try:
        cfg = load_agent_config(a.config)
    except ConfigError as e:
        audit.setup("", {"client": client})  # stderr only
        audit.record(log, "refused", logging.ERROR, reason=f"agent config: {e}")
        print(json.dumps({"ok": False, "error": f"agent config: {e}"}), flush=True)
        return 78
    problem = audit.setup(cfg.audit_log, {"client": client})
    if problem:
        audit.record(log, "audit log unusable", logging.ERROR, reason=problem)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _ended)
    return serve(cfg, command, audit_problem=problem)


if __name__ == "__main__":
    sys.exit(main())
