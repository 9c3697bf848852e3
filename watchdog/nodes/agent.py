"""The watchdog's agent on another node: the forced command its SSH key is bound to.

``command="/opt/engine-watchdog/.venv/bin/python -m watchdog.nodes.agent --config /etc/engine-watchdog/agent.toml"``
in ``authorized_keys``: whatever the client asks, sshd runs this, with the request in ``SSH_ORIGINAL_COMMAND``.
It accepts one bare verb (`protocol.VERBS`), reads the arguments as JSON on stdin (capped), answers JSON on stdout.
It runs only what this node's own config allows; anything else is refused, with the reason, and written to the
audit log here. It listens on nothing: sshd is the only door.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from watchdog import __version__
from watchdog.config.load import ConfigError
from watchdog.config.nodes import MAX_LOG_LINES
from watchdog.evidence.collect.capture import Capturer, find_pyspy
from watchdog.evidence.collect.context import LogSource, installed_versions, log_tail
from watchdog.evidence.collect.discover import discover
from watchdog.host.ptrace import attach_check
from watchdog.host.run import LocalRunner
from watchdog.nodes.agent_config import DEFAULT_PATH, AgentConfig, load_agent_config, normal
from watchdog.nodes.protocol import (
    MAX_REQUEST_BYTES,
    PROTOCOL,
    LogRefused,
    ProtocolError,
    capture_to_json,
    choose_log,
    parse_args,
    parse_verb,
    process_to_json,
    want_list,
    want_number,
)
from watchdog.nodes.ranks import RankTracker
from watchdog.nodes.shm import shm_segments

log = logging.getLogger("watchdog.agent")


def _shm_names(shm_dir: str) -> list[str]:
    try:
        return [s.name for s in shm_segments(shm_dir)]
    except OSError:  # the context goes on without them; the `shm` verb says why
        return []


class Refused(Exception):
    """A request this node does not run; the message goes back to the head and into the audit log."""


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.pyspy = find_pyspy(cfg.pyspy)

    def processes(self) -> list[Any]:
        return discover(None, self.cfg.process_prefix, self.cfg.title_filter)

    def handle(self, verb: str, args: dict[str, Any]) -> dict[str, Any]:
        return dict(getattr(self, f"verb_{verb}")(args))

    def verb_version(self, args: dict[str, Any]) -> dict[str, Any]:
        procs = self.processes()
        allowed, why = attach_check()
        return {"version": __version__, "protocol": PROTOCOL, "hostname": socket.gethostname(), "time": time.time(),
                "pyspy": self.pyspy, "ptrace_allowed": allowed, "ptrace": why,
                "ranks": [p.title for p in procs if p.ranks], "processes": len(procs)}

    def verb_list(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"time": time.time(), "processes": [process_to_json(p) for p in self.processes()]}

    def verb_stacks(self, args: dict[str, Any]) -> dict[str, Any]:
        wanted = set(want_list(args, "pids", int))
        rounds = int(want_number(args, "rounds", 2, 1, 5))
        gap = want_number(args, "gap", 3.0, 0, 30)
        timeout = want_number(args, "timeout", self.cfg.capture_timeout, 0.5, 60)
        found = self.processes()
        if wanted - {p.pid for p in found}:  # py-spy runs on this node's engine processes only
            raise Refused(f"not engine processes here: {sorted(wanted - {p.pid for p in found})}")
        chosen = [p for p in found if p.pid in wanted] if wanted else found
        capturer = Capturer(self.pyspy, timeout, bool(args.get("native")), bool(args.get("locals")))
        t0 = time.time()
        capture = capturer.capture(chosen, rounds, gap)
        # our dumps carry monotonic times; the head moves them onto its clock with this pair
        return {"capture": capture_to_json(capture), "time": t0, "monotonic": capturer.clock(), "wall": time.time()}

    def verb_context(self, args: dict[str, Any]) -> dict[str, Any]:
        """Log tail, versions, /dev/shm. The log is the one the head's entry names if this node's config allows
        exactly that one (else refused: said in the answer and the audit log), or this node's own when it names none."""
        lines = int(want_number(args, "lines", 200, 0, MAX_LOG_LINES))
        own = {"journal_unit": self.cfg.journal_unit, "docker_container": self.cfg.docker_container,
               "log_file": self.cfg.log_file}
        refused = ""
        try:
            kind, name = choose_log(args.get("log"), own)
        except LogRefused as e:
            log.warning("refused: %s", e)
            kind, name, refused = "", "", str(e)
        pick = {k: name if kind == k else "" for k in ("log_file", "journal_unit", "docker_container")}
        src = LogSource(pick["log_file"], pick["journal_unit"], pick["docker_container"], lines)
        tail, where, problem = log_tail(src)
        pids = [p.pid for p in self.processes() if p.ranks]
        ours = {"watchdog": __version__, "python": sys.version.split()[0]}
        return {"time": time.time(), "log_tail": tail[-512 * 1024:], "log_source": where,
                "problem": refused or problem, "log_refused": refused,
                "versions": installed_versions(pids, self.pyspy, versions=ours), "shm": _shm_names(self.cfg.shm_dir)}

    def verb_liveness(self, args: dict[str, Any]) -> dict[str, Any]:
        interval = want_number(args, "interval", 2.0, 0.2, 60)
        tracker = RankTracker(self.processes, rediscover_every=max(30.0, interval * 10))
        seq = 0
        while True:  # until the head ends the session: the write then fails
            report = {"ok": True, "seq": seq, "time": time.time(), "ranks": tracker.poll()}
            sys.stdout.write(json.dumps(report) + "\n")
            sys.stdout.flush()
            seq += 1
            time.sleep(interval)

    def verb_run(self, args: dict[str, Any]) -> dict[str, Any]:
        argv = tuple(want_list(args, "argv", str))
        timeout = want_number(args, "timeout", 300, 0.1, 7200)
        if not argv or normal(argv) not in self.cfg.allowed():
            raise Refused(f"not allowed by this node's config ({self.cfg.source}): {' '.join(argv)[:200]}")
        log.info("running %s for the head (timeout %gs)", argv, timeout)
        r = LocalRunner()(argv, timeout)
        return {"argv": list(r.argv), "rc": r.rc, "duration": r.duration, "timed_out": r.timed_out,
                "output": r.output, "error": r.error}

    def verb_shm(self, args: dict[str, Any]) -> dict[str, Any]:
        remove = bool(args.get("remove"))
        if remove and not self.cfg.remove_shm:
            raise Refused(f"removing /dev/shm segments is not allowed by this node's config ({self.cfg.source})")
        segs = shm_segments(self.cfg.shm_dir)
        removed, kept = [], []
        for s in segs:
            if remove and s.stale:
                try:
                    os.unlink(s.path)
                    removed.append(s.name)
                    continue
                except OSError as e:
                    log.warning("cannot remove %s: %s", s.path, e)
            kept.append({"name": s.name, "bytes": s.size, "in_use": not s.stale})
        return {"segments": kept, "removed": removed,
                "stale_bytes": sum(s.size for s in segs if s.stale and s.name not in removed)}


def _audit(path: str) -> None:
    handlers: list[logging.Handler] = []
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path))
    except OSError:
        pass
    handlers.append(logging.StreamHandler(sys.stderr))  # sshd hands stderr to the head too
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s watchdog-agent[%(process)d] %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="watchdog-agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_PATH)
    a = p.parse_args(argv)
    command = os.environ.get("SSH_ORIGINAL_COMMAND")
    try:
        cfg = load_agent_config(a.config)
    except ConfigError as e:
        print(json.dumps({"ok": False, "error": f"agent config: {e}"}), flush=True)
        return 78
    _audit(cfg.audit_log)
    client = os.environ.get("SSH_CLIENT", "?").split(" ")[0]
    try:
        verb = parse_verb(command)
        args = parse_args(sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)) if verb != "version" else {}
        if verb != "liveness":
            log.info("%s from %s", verb, client)
        answer = Agent(cfg).handle(verb, args)
    except (ProtocolError, Refused) as e:
        log.warning("refused from %s: %s", client, e)
        print(json.dumps({"ok": False, "error": str(e)}), flush=True)
        return 2
    except BrokenPipeError:  # the head ended a liveness stream
        return 0
    print(json.dumps({"ok": True, **answer}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
