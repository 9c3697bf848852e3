"""OpenSSH to another node: key auth, batch mode, the node's host key checked against its own known_hosts (never
learned on first use), and one multiplexed connection per node, so that a call costs milliseconds.

`open_links` builds one link per ``[[nodes]]`` entry, once, for every stage that talks to that node (liveness,
capture, restart); its owner ends them with `close_links`.

The shared connection is a ``ssh -M -N`` master this object starts and owns (its own session; ended by its pid in
`close`), with its socket in a private directory (0700). Every call is ``ssh -o ControlMaster=no ... -- <verb>``
through it, run by `watchdog.host.run.communicate`: the arguments as JSON on stdin, the answer read with a deadline
and a byte cap; past either, the call's own ssh process group is ended. No port of ours listens anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from watchdog.config.nodes import NodeSection
from watchdog.host.childenv import child_env
from watchdog.host.run import communicate, end_group
from watchdog.nodes.protocol import ProtocolError, clean, parse_answer

KILL_GRACE = 1.0  # seconds from SIGTERM to SIGKILL for an ssh process we end
MAX_STDERR = 64 * 1024


class NodeError(Exception):
    """A call to a node failed; ``kind``: unreachable, host_key, auth, refused, timeout, too_big, agent."""

    def __init__(self, node: str, kind: str, message: str, detail: str = "") -> None:
        super().__init__(f"node {node}: {message}")
        self.node, self.kind, self.message = node, kind, message
        self.detail = detail  # the call's stderr tail when the answer was not the agent's (a wrong forced command)


def classify_ssh(stderr: str) -> tuple[str, str]:
    """(kind, a clear message) out of ssh's stderr."""
    low = stderr.lower()
    if "host key verification failed" in low or "remote host identification has changed" in low \
            or "no matching host key" in low:
        return "host_key", ("host key verification failed: the node's key is not the one in its known_hosts_file "
                            "(never learned on first use; add the right key by hand)")
    if "permission denied" in low:
        return "auth", "the node refused our key (permission denied): its authorized_keys does not hold this key"
    if "connection timed out" in low or "no route to host" in low or "network is unreachable" in low:
        return "unreachable", "cannot reach the node: " + stderr.strip().splitlines()[-1][:200]
    if "connection refused" in low or "could not resolve" in low or "connection closed" in low \
            or "connection reset" in low:
        return "unreachable", "cannot reach the node: " + stderr.strip().splitlines()[-1][:200]
    return "unreachable", "ssh failed: " + (stderr.strip()[-300:] or "no message")


class NodeLink:
    """One node: its shared connection, its calls."""

    def __init__(self, node: NodeSection, control_dir: Path | None = None, ssh: str = "ssh") -> None:
        self.node, self.ssh = node, ssh
        self._own_dir = control_dir is None
        self.dir = Path(control_dir or tempfile.mkdtemp(prefix="watchdog-ssh-"))
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.socket = self.dir / f"{node.name}.sock"
        self._master: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def argv(self, *extra: str) -> list[str]:
        n = self.node
        opts = {"BatchMode": "yes", "StrictHostKeyChecking": "yes", "UserKnownHostsFile": n.known_hosts_file,
                "GlobalKnownHostsFile": "/dev/null", "IdentitiesOnly": "yes", "IdentityAgent": "none",
                "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
                "ConnectTimeout": str(max(1, int(n.connect_timeout))), "ControlPath": str(self.socket),
                "ServerAliveInterval": "5", "ServerAliveCountMax": "2", "LogLevel": "ERROR",
                "ClearAllForwardings": "yes", "RequestTTY": "no"}
        args = [self.ssh, "-F", "/dev/null", "-i", n.identity_file, "-p", str(n.port), "-l", n.user]
        for k, v in opts.items():
            args += ["-o", f"{k}={v}"]
        return [*args, *extra]

    def connect(self) -> None:
        """Start the shared connection if it is not up; raise NodeError saying why it cannot be."""
        with self._lock:
            if self._master is not None and self._master.poll() is None and self.socket.exists():
                return
            self._close_master()
            errlog = self.dir / f"{self.node.name}.master.log"
            # a Popen of its own, not `host.run`: the master lives as long as the link, it does not run to completion
            with open(errlog, "wb") as err:
                self._master = subprocess.Popen(
                    self.argv("-M", "-N", "-o", "ControlMaster=yes", "-o", "ControlPersist=no", "--",
                              self.node.host),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                    env=child_env())
            deadline = time.monotonic() + self.node.connect_timeout + 2
            # not tenacity: this waits for the master's socket to appear while watching the master itself, it retries
            # no call (a master that exits is the answer, at once)
            while time.monotonic() < deadline:
                if self.socket.exists():
                    return
                if self._master.poll() is not None:
                    break
                time.sleep(0.02)
            self._close_master()
            kind, message = classify_ssh(errlog.read_text(errors="replace") or "connection timed out")
            raise NodeError(self.node.name, kind, message)

    def _close_master(self) -> None:
        if self._master is not None:
            if self._master.poll() is None:
                end_group(self._master, KILL_GRACE)
            self._master.wait()
            self._master = None
        self.socket.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._close_master()
        if self._own_dir:
            for f in self.dir.iterdir():
                f.unlink(missing_ok=True)
            self.dir.rmdir()

    def verb_argv(self, verb: str) -> list[str]:
        """The ssh command line running ``verb`` on the node through the shared connection."""
        return self.argv("-o", "ControlMaster=no", "--", self.node.host, verb)

    def start(self, verb: str) -> subprocess.Popen[bytes]:
        """A long-lived ssh session running ``verb`` (a stream: `watch`), in its own session; the caller ends it."""
        self.connect()
        return subprocess.Popen(self.verb_argv(verb), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, env=child_env())

    def call(self, verb: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """One verb, its answer; NodeError for every failure (unreachable, refused, too slow, too big)."""
        limit = timeout if timeout is not None else self.node.call_timeout
        self.connect()
        # stderr (the agent's audit lines, ssh's messages) is diagnostics: past its cap only its tail is kept, so a
        # node's chatty stderr (a local user's many titled processes, each one audit line) cannot fail the call
        raw = communicate(self.verb_argv(verb), limit, json.dumps(args or {}).encode(), self.node.max_bytes,
                          MAX_STDERR, KILL_GRACE, stderr_overflow="tail")
        name = self.node.name
        if raw.timed_out:
            raise NodeError(name, "timeout", f"{verb}: no answer within {limit:g}s (the call was ended)")
        if raw.too_big:
            what = (f"answer (stdout) over {self.node.max_bytes} bytes" if raw.error.startswith("stdout")
                    else f"stderr over {MAX_STDERR} bytes")
            raise NodeError(name, "too_big", f"{verb}: {what} (the call was ended)")
        if raw.rc is None:  # ssh itself could not start
            raise NodeError(name, "unreachable", f"{verb}: {raw.error}")
        if raw.rc == 255 and not raw.stdout:
            kind, message = classify_ssh(raw.stderr.decode(errors="replace"))
            raise NodeError(name, kind, f"{verb}: {message}")
        out = raw.stdout.strip()
        try:
            return parse_answer(out.splitlines()[-1] if out else b"")
        except ProtocolError as e:
            kind = "refused" if out and b'"ok": false' in raw.stdout else "agent"
            raise NodeError(name, kind, f"{verb}: {e}", clean(raw.stderr.decode(errors="replace")[-300:])) from None


def open_links(nodes: Iterable[NodeSection]) -> dict[str, NodeLink]:
    """One link per node, by name; each connects on its first call."""
    return {n.name: NodeLink(n) for n in nodes}


def close_links(links: Mapping[str, NodeLink]) -> None:
    """End every link's shared connection (and its private directory)."""
    for link in links.values():
        link.close()
