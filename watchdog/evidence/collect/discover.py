"""Find an engine's processes in /proc (through psutil): the API server, EngineCore, every worker rank.

vLLM titles its processes with setproctitle (``VLLM::EngineCore``, ``VLLM::Worker_TP1``, ...); ``comm`` is
cut to 15 characters, so titles are read from the command line. The engine behind a URL is found from the
process listening on its port and that process's descendants; when the listener is not visible (another
network namespace, a container), every titled process on the host is taken, optionally filtered.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from watchdog.core.processes import EngineProcess
from watchdog.core.roles import ENGINE_ROLES, ORDER, Role, parse_title

log = logging.getLogger(__name__)

def title_of(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""
    return " ".join(cmdline).strip()


def listener_pid(url: str) -> int | None:
    """The pid listening on the URL's TCP port on this host, if visible."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError) as e:
        log.debug("cannot list sockets: %s", e)
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def _describe(proc: psutil.Process, prefix: str) -> EngineProcess | None:
    title = title_of(proc)
    parsed = parse_title(title, prefix)
    if parsed is None:
        return None
    role, ranks = parsed
    try:
        ppid = proc.ppid()
    except psutil.Error:
        ppid = None
    return EngineProcess(proc.pid, role, title.split(" ", 1)[0], ranks, ppid)


def discover(url: str | None = None, prefix: str = "VLLM::", title_filter: str = "",
             processes: Iterable[psutil.Process] | None = None) -> list[EngineProcess]:
    """The engine processes behind ``url`` (its listener and descendants), else every titled one on the host."""
    found: list[EngineProcess] = []
    root_pid = listener_pid(url) if url else None
    if root_pid is not None and processes is None:
        try:
            root = psutil.Process(root_pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            desc = _describe(proc, prefix)
            if desc is None and proc.pid == root_pid:
                desc = EngineProcess(proc.pid, Role.API_SERVER, "", {}, None)
            if desc is not None:
                found.append(desc)
        if not any(p.role in ENGINE_ROLES for p in found):
            log.info("the listener on %s (pid %d) has no engine processes under it", url, root_pid)
        return _filtered(found, title_filter)
    for proc in processes if processes is not None else psutil.process_iter():
        desc = _describe(proc, prefix)
        if desc is not None:
            found.append(desc)
    return _filtered(found, title_filter)


def _filtered(found: list[EngineProcess], title_filter: str) -> list[EngineProcess]:
    if title_filter:
        found = [p for p in found if title_filter in p.title or p.role == "api_server"]
    return sorted(found, key=lambda p: (ORDER.get(p.role, 4), sorted(p.ranks.items()), p.pid))


@dataclass(frozen=True, slots=True)
class ServerTree:
    """A vLLM server process for a port (found by its command line) and the titles of its descendants."""

    pid: int
    started: float  # wall clock, seconds since the epoch
    titles: tuple[str, ...]


def _serves_port(cmdline: list[str], port: int) -> bool:
    """A vLLM API server (``python -m vllm.entrypoints...`` or ``vllm serve``) for this port."""
    server = any(a.startswith("vllm.entrypoints") for a in cmdline) or (
        len(cmdline) >= 2 and Path(cmdline[0]).name == "vllm" and cmdline[1] == "serve")
    if not server:
        return False
    for i, arg in enumerate(cmdline):
        if arg == "--port" and i + 1 < len(cmdline):
            return cmdline[i + 1] == str(port)
        if arg.startswith("--port="):
            return arg.split("=", 1)[1] == str(port)
    return port == 8000  # vLLM's default port


def server_for_port(url: str, processes: Iterable[psutil.Process] | None = None) -> ServerTree | None:
    """The vLLM server that will listen on the URL's port, even before it binds it (it loads weights first).

    Found by command line (``vllm serve``/``api_server`` with ``--port``), so it works while the port is closed.
    """
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for proc in processes if processes is not None else psutil.process_iter():
        try:
            cmdline = proc.cmdline()
            if not cmdline or cmdline[0].startswith("VLLM::") or not _serves_port(cmdline, port):
                continue
            started = proc.create_time()
            titles = tuple(sorted({t.split(" ", 1)[0] for t in map(title_of, proc.children(recursive=True))
                                   if t.startswith("VLLM::")}))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        return ServerTree(proc.pid, started, titles)
    return None
