"""An engine in a container, seen from the host: through Docker's userland proxy, or by the container's init pid.

With a published port (``-p 18711:8000``) and Docker's default userland proxy, the host's listener on the URL's
port is ``docker-proxy`` (``-container-ip 172.17.0.2 -container-port 8000`` in its argv), whose descendants are
not the engine. The API server is the process, in another network namespace, that listens on the container port:
its namespace's ``/proc/PID/net/tcp{,6}`` shows a LISTEN socket on that port, the process holds that socket's inode
among its ``/proc/PID/fd``, and the namespace owns the container's address (``/proc/PID/net/fib_trie``).

The parsing (argv, fib_trie) takes text and reads nothing; `ProcFS` reads a /proc tree (the host's, or a fake one
in the tests; its tcp tables and sockets through `watchdog.host.sockets`); `server_behind_proxy` chooses. `InitPids`
keeps a named container's init pid (`watchdog.host.docker_cli.container_pid`, for the userland proxy off: no host
listener at all) while that process lives.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog.host.docker_cli import Runner, container_pid
from watchdog.host.proc_stat import read_stat
from watchdog.host.sockets import read_listeners, socket_inodes

__all__ = ["InitPids", "ProcFS", "ProxyTarget", "is_docker_proxy", "local_addresses",
           "parse_docker_proxy", "server_behind_proxy", "topmost"]


@dataclass(frozen=True, slots=True)
class ProxyTarget:
    """Where a docker-proxy forwards: the container's address and port (and the host port it listens on)."""

    container_ip: str
    container_port: int
    host_port: int | None = None


def is_docker_proxy(argv: Sequence[str]) -> bool:
    return bool(argv) and os.path.basename(argv[0]) == "docker-proxy"


def parse_docker_proxy(argv: Sequence[str]) -> ProxyTarget | None:
    """The target of a ``docker-proxy`` command line (``-flag value``, ``-flag=value``, ``--flag``); None when the
    argv is not docker-proxy's or names no container port (a UDP proxy included: not an HTTP server)."""
    if not is_docker_proxy(argv):
        return None
    flags: dict[str, str] = {}
    args = list(argv[1:])
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            name = a.lstrip("-")
            if "=" in name:
                k, v = name.split("=", 1)
                flags[k] = v
            elif i + 1 < len(args):
                flags[name] = args[i + 1]
                i += 1
        i += 1
    if flags.get("proto", "tcp") != "tcp":
        return None
    try:
        port = int(flags["container-port"])
        host_port = int(flags["host-port"]) if "host-port" in flags else None
    except (KeyError, ValueError):
        return None
    if not 0 < port < 65536:
        return None
    return ProxyTarget(flags.get("container-ip", ""), port, host_port)


def local_addresses(fib_trie: str) -> set[str]:
    """The addresses a network namespace owns (``/32 host LOCAL`` leaves of /proc/PID/net/fib_trie)."""
    out: set[str] = set()
    last = ""
    for line in fib_trie.splitlines():
        s = line.strip()
        if s.startswith(("|--", "+--")):
            last = s[3:].strip().split(" ", 1)[0]
        elif "/32 host LOCAL" in s and last:
            with contextlib.suppress(ValueError):
                out.add(str(ipaddress.ip_address(last)))
    return out


class ProcFS:
    """The slice of a /proc tree that finding a server across network namespaces reads. ``root``: "/proc" on the
    host; a directory laid out the same way in the tests. Every read answers None/empty when it cannot be read."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def _read(self, pid: int, name: str) -> str:
        try:
            return (Path(self.root) / str(pid) / name).read_text(errors="replace")
        except OSError:
            return ""

    def pids(self) -> list[int]:
        try:
            return sorted(int(p) for p in os.listdir(self.root) if p.isdigit())
        except OSError:
            return []

    def netns(self, pid: int) -> str | None:
        try:
            return os.readlink(f"{self.root}/{pid}/ns/net")
        except OSError:
            return None

    def ppid(self, pid: int) -> int | None:
        for line in self._read(pid, "status").splitlines():
            if line.startswith("PPid:"):
                try:
                    return int(line.split()[1])
                except (IndexError, ValueError):
                    return None
        return None

    def listening(self, pid: int, port: int) -> set[int]:
        """Inodes of the sockets listening on ``port`` in ``pid``'s network namespace."""
        return {x.inode for x in read_listeners(pid, self.root) if x.port == port}

    def addresses(self, pid: int) -> set[str]:
        return local_addresses(self._read(pid, "net/fib_trie"))

    def sockets(self, pid: int) -> set[int]:
        """Inodes of the sockets ``pid`` holds open."""
        return socket_inodes(pid, self.root)


def server_behind_proxy(proxy_pid: int, target: ProxyTarget, fs: ProcFS | None = None) -> int | None:
    """The pid, in a network namespace other than the proxy's, that listens on the container port; among several
    namespaces, those owning ``target.container_ip`` first; among a namespace's holders of the socket, the one none
    of whose ancestors holds it (a child that inherited the socket is not the server). None when none is seen."""
    fs = fs or ProcFS()
    own = fs.netns(proxy_pid)
    by_ns: dict[str, set[int]] = {}  # netns -> its listening inodes on the port
    holders: dict[str, list[int]] = {}
    for pid in fs.pids():
        ns = fs.netns(pid)
        if ns is None or ns == own:
            continue
        if ns not in by_ns:
            by_ns[ns] = fs.listening(pid, target.container_port)
        if by_ns[ns] and by_ns[ns] & fs.sockets(pid):
            holders.setdefault(ns, []).append(pid)
    if not holders:
        return None
    namespaces = list(holders)
    if target.container_ip and len(namespaces) > 1:
        owning = [ns for ns in namespaces if target.container_ip in fs.addresses(holders[ns][0])]
        namespaces = owning or namespaces
    pids = holders[namespaces[0]]
    return topmost(pids, fs.ppid)


def topmost(pids: Iterable[int], ppid: Callable[[int], int | None]) -> int:
    """The first of ``pids`` (lowest pid first) none of whose ancestors is among them."""
    chosen = sorted(set(pids))
    among = set(chosen)
    for pid in chosen:
        seen: set[int] = set()
        up = ppid(pid)
        while up is not None and up > 1 and up not in seen and up not in among:
            seen.add(up)
            up = ppid(up)
        if up is None or up not in among:
            return pid
    return chosen[0]


def _started(pid: int) -> float | None:
    """When ``pid`` started (its identity against reuse of the number); None when it is gone."""
    st = read_stat(pid)
    return None if st is None else st.starttime


class InitPids:
    """`container_pid` remembered: a container's init pid is asked of Docker once and kept while that same process
    lives (a restarted container has a new one; a reused pid number has another start time), so a watch loop that
    looks for a booting server each tick does not start ``docker inspect`` each tick."""

    def __init__(self, started: Callable[[int], float | None] = _started) -> None:
        self.started = started
        self.known: dict[str, tuple[int, float]] = {}

    def __call__(self, name: str, runner: Runner, timeout: float = 10.0) -> tuple[int | None, str]:
        if name in self.known:
            pid, t = self.known[name]
            if self.started(pid) == t:
                return pid, ""
            del self.known[name]
        found, why = container_pid(name, runner, timeout)
        if found is not None and (t0 := self.started(found)) is not None:
            self.known[name] = (found, t0)
        return found, why
