"""A real HAProxy (Debian's `haproxy`, installed by scripts/setup) in front of engines, for tests and benchmarks.

One process, in its own session, started with a config of the caller's making (`listen_section` writes the two
kinds the scenario needs: checks on each watchdog's /readyz, or on vLLM's own /health), logging every request to
its stdout (a file): the server that got it and when it was accepted. Its admin socket tells each server's state
(UP, DOWN, ...) when asked; `StateWatch` asks every 0.1 s and keeps the changes with their times.

Everything listens on loopback. Stopped by its own pid (SIGTERM to its own process group, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HAPROXY = "/usr/sbin/haproxy"
# accept time (epoch s.ms; on a kept-alive connection, when the previous request ended), handshake and idle time
# before the request (ms: the request came at accept + both), the proxy, the server, total time (ms), status,
# termination state
LOG_FORMAT = "req %Ts.%ms %Th %Ti %b %s %Ta %ST %tsc"


def listen_section(name: str, port: int, check_path: str, servers: list[tuple[str, int, int | None]],
                   shutdown_on_down: bool = False) -> str:
    """A `listen` proxy on 127.0.0.1:`port`, round robin over `servers` (name, engine port, check port or None for
    the engine's own), `option httpchk GET check_path`, a check every second, out after 2 failures, back after 2."""
    default = "default-server inter 1s fall 2 rise 2"
    if shutdown_on_down:
        default += " on-marked-down shutdown-sessions"
    lines = [f"listen {name}", f"    bind 127.0.0.1:{port}", "    balance roundrobin",
             f"    option httpchk GET {check_path}", "    http-check expect status 200", f"    {default}",
             "    http-response set-header X-Engine %s"]
    for server, engine_port, check_port in servers:
        lines.append(f"    server {server} 127.0.0.1:{engine_port} check"
                     + (f" port {check_port}" if check_port else ""))
    return "\n".join(lines) + "\n"


def config(sections: list[str], admin_socket: Path) -> str:
    return f"""global
    log stdout format raw local0
    stats socket {admin_socket} mode 600 level admin
    maxconn 512
defaults
    mode http
    log global
    log-format "{LOG_FORMAT}"
    option log-health-checks
    timeout connect 2s
    timeout client 300s
    timeout server 300s
    timeout check 2s
    retries 2
    option redispatch
""" + "".join(sections)


@dataclass(frozen=True)
class Logged:
    accepted: float  # epoch seconds when the request came (its connection's accept, plus handshake and idle time)
    proxy: str
    server: str
    total_ms: int
    status: int
    termination: str


class HAProxy:
    def __init__(self, workdir: Path, sections: list[str]) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "admin.sock"
        self.cfg = self.dir / "haproxy.cfg"
        self.cfg.write_text(config(sections, self.socket))
        self.log_path = self.dir / "haproxy.log"
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> HAProxy:
        check = subprocess.run([HAPROXY, "-c", "-f", str(self.cfg)], capture_output=True, text=True, timeout=30,
                               check=False)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refuses its config:\n{check.stdout}{check.stderr}")
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen([HAPROXY, "-db", "-f", str(self.cfg)], stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self._popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start:\n{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        p = self._popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)  # its own group: the pid is the group id, ours alone until reaped
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def ask(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(command.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode(errors="replace")

    def table(self) -> dict[tuple[str, str], tuple[str, int]]:
        """(proxy, server) -> (status, requests sent to it so far). The status as HAProxy shows it: UP, DOWN, "UP 1/2"
        (going down), "DOWN 1/2" (coming up); the count is its `stot`, counted when a request is given to the server,
        whatever becomes of it (a request that hangs or is cut is never in the request log: it ends no response)."""
        lines = self.ask("show stat").splitlines()
        if not lines or not lines[0].startswith("# "):
            return {}
        head = lines[0][2:].split(",")
        out = {}
        for line in lines[1:]:
            row = dict(zip(head, line.split(","), strict=False))
            if row.get("svname") not in (None, "FRONTEND", "BACKEND"):
                out[(row["pxname"], row["svname"])] = (row.get("status", ""), int(row.get("stot") or 0))
        return out

    def states(self) -> dict[tuple[str, str], str]:
        return {k: status for k, (status, _) in self.table().items()}

    def requests(self) -> list[Logged]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 9 and parts[0] == "req":
                with contextlib.suppress(ValueError):
                    came = float(parts[1]) + (max(0, int(parts[2])) + max(0, int(parts[3]))) / 1000
                    out.append(Logged(came, parts[4], parts[5], int(parts[6]), int(parts[7]), parts[8]))
        return out

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class StateWatch:
    """Polls `HAProxy.table()` every `every` s in a thread: `changes` is [(epoch s, (proxy, server), status)],
    `totals` [(epoch s, (proxy, server), requests sent to it so far)], each when it changed."""

    def __init__(self, lb: HAProxy, every: float = 0.1) -> None:
        self.lb, self.every = lb, every
        self.changes: list[tuple[float, tuple[str, str], str]] = []
        self.totals: list[tuple[float, tuple[str, str], int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="haproxy-states", daemon=True)

    def __enter__(self) -> StateWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        seen: dict[tuple[str, str], tuple[str, int]] = {}
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                now = time.time()
                for key, (status, total) in self.lb.table().items():
                    before = seen.get(key)
                    if before is None or before[0] != status:
                        self.changes.append((now, key, status))
                    if before is None or before[1] != total:
                        self.totals.append((now, key, total))
                    seen[key] = (status, total)
            self._stop.wait(self.every)

    def first(self, key: tuple[str, str], status: str, after: float = 0.0) -> float | None:
        """When `key` was first seen with exactly `status` at or after `after`."""
        return next((t for t, k, s in self.changes if k == key and s == status and t >= after), None)

    def sent_between(self, key: tuple[str, str], start: float, end: float) -> int:
        """Requests given to that server between two times, as the polls saw the count (to within a poll)."""
        def at(when: float) -> int:
            return max((n for t, k, n in self.totals if k == key and t <= when), default=0)
        return at(end) - at(start)

    def status_at(self, key: tuple[str, str], when: float) -> str:
        last = ""
        for t, k, s in self.changes:
            if k == key and t <= when:
                last = s
        return last
