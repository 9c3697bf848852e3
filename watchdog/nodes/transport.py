"""OpenSSH to another node: key auth, batch mode, the node's host key checked against its own known_hosts (never
learned on first use), and one multiplexed connection per node, so that a call costs milliseconds.

The shared connection is a ``ssh -M -N`` master this object starts and owns (its own session; ended by its pid in
`close`), with its socket in a private directory (0700). Every call is ``ssh -o ControlMaster=no ... -- <verb>``
through it: the arguments as JSON on stdin, the answer read with a deadline and a byte cap; past either, the call's
own ssh process group is killed. No port of ours listens anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.config.nodes import NodeSection
from watchdog.host.childenv import child_env
from watchdog.nodes.protocol import ProtocolError, parse_answer


class NodeError(Exception):
    """A call to a node failed; ``kind``: unreachable, host_key, auth, refused, timeout, too_big, agent."""

    def __init__(self, node: str, kind: str, message: str) -> None:
        super().__init__(f"node {node}: {message}")
        self.node, self.kind, self.message = node, kind, message


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


@dataclass(frozen=True, slots=True)
class Raw:
    rc: int | None
    out: bytes
    err: bytes
    timed_out: bool = False
    too_big: bool = False


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def bounded(proc: subprocess.Popen[bytes], data: bytes, timeout: float, max_bytes: int) -> Raw:
    """Send ``data``, read stdout and stderr until EOF, the deadline or the cap; kill the group past either."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except OSError:
        pass
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        open_ = 2
        while open_:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc)
                return Raw(None, bytes(out), bytes(err), timed_out=True)
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_ -= 1
                    continue
                key.data.extend(chunk)
                if len(out) > max_bytes or len(err) > 64 * 1024:
                    _kill_group(proc)
                    return Raw(None, bytes(out[:max_bytes]), bytes(err[:65536]), too_big=True)
    try:
        rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return Raw(None, bytes(out), bytes(err), timed_out=True)
    return Raw(rc, bytes(out), bytes(err))


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
            with open(errlog, "wb") as err:
                self._master = subprocess.Popen(
                    self.argv("-M", "-N", "-o", "ControlMaster=yes", "-o", "ControlPersist=no", "--",
                              self.node.host),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                    env=child_env())
            deadline = time.monotonic() + self.node.connect_timeout + 2
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
                _kill_group(self._master)
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

    def start(self, verb: str) -> subprocess.Popen[bytes]:
        """An ssh session running ``verb`` on the node through the shared connection, in its own session."""
        self.connect()
        return subprocess.Popen(self.argv("-o", "ControlMaster=no", "--", self.node.host, verb),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=child_env())

    def call(self, verb: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """One verb, its answer; NodeError for every failure (unreachable, refused, too slow, too big)."""
        limit = timeout if timeout is not None else self.node.call_timeout
        raw = bounded(self.start(verb), json.dumps(args or {}).encode(), limit, self.node.max_bytes)
        name = self.node.name
        if raw.timed_out:
            raise NodeError(name, "timeout", f"{verb}: no answer within {limit:g}s (the call was ended)")
        if raw.too_big:
            raise NodeError(name, "too_big", f"{verb}: answer over {self.node.max_bytes} bytes (the call was ended)")
        if raw.rc == 255 and not raw.out:
            kind, message = classify_ssh(raw.err.decode(errors="replace"))
            raise NodeError(name, kind, f"{verb}: {message}")
        try:
            return parse_answer(raw.out.strip().splitlines()[-1] if raw.out.strip() else b"")
        except ProtocolError as e:
            kind = "refused" if raw.out.strip() and b'"ok": false' in raw.out else "agent"
            raise NodeError(name, kind, f"{verb}: {e}") from None
