"""Find an engine's processes in /proc (through psutil): the API server, EngineCore, every worker rank.

vLLM titles its processes with setproctitle (``VLLM::EngineCore``, ``VLLM::Worker_TP1``, ...); ``comm`` is
cut to 15 characters, so titles are read from the command line. The engine behind a URL is found from the
process listening on its port and that process's descendants. In a container (docs/docker.md): when that listener
is Docker's userland proxy, the API server is the process listening on the container port in another network
namespace (`watchdog.evidence.collect.proxy`); when nothing listens on the host (the proxy off) and
``[capture] docker_container`` names the container, its init pid's descendants. When none of these is seen, every
titled process on the host is taken, optionally filtered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from watchdog.core.processes import EngineProcess
from watchdog.core.roles import ENGINE_ROLES, ORDER, Role, parse_title
from watchdog.evidence.collect.capture import run_argv
from watchdog.evidence.collect.proxy import InitPids, ProcFS, parse_docker_proxy, server_behind_proxy

Runner = Callable[[Sequence[str], float], tuple[int, str, str]]
INIT_PIDS = InitPids()  # named containers' init pids, asked of Docker once per container start
WATCH_INSPECT_TIMEOUT = 3.0  # docker inspect from the watch loop (a hung daemon must not hold the loop long)

log = logging.getLogger(__name__)

def title_of(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""
    return " ".join(cmdline).strip()


def url_port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def listener_pid(url: str) -> int | None:
    """The pid listening on the URL's TCP port on this host, if visible."""
    port = url_port(url)
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


def _argv(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def engine_root(url: str | None, container: str = "", runner: Runner = run_argv,
                fs: ProcFS | None = None) -> tuple[int, bool] | None:
    """(pid, is the API server) whose descendants are the engine: the URL's listener (a docker-proxy's server in
    the container behind it), else the named container's init pid (not itself the server), else None."""
    pid = listener_pid(url) if url else None
    if pid is not None and _is_dockerd(_argv(pid)):  # the userland proxy off: dockerd holds the port to reserve it,
        log.info("the listener on %s is dockerd (pid %d): the engine is in a container behind its NAT", url, pid)
        pid = None  # and iptables carries the traffic into the container: the engine is found by its name
    if pid is not None:
        target = parse_docker_proxy(_argv(pid))
        if target is None:
            return pid, True
        server = server_behind_proxy(pid, target, fs)
        if server is not None:
            return server, True
        log.info("the listener on %s is docker-proxy (pid %d) for %s:%d, where nothing is seen listening", url, pid,
                 target.container_ip, target.container_port)
    if container:
        init, why = INIT_PIDS(container, runner)
        if init is not None:
            return init, False
        log.warning("engine discovery: %s", why)
    return None


def _is_dockerd(argv: Sequence[str]) -> bool:
    return bool(argv) and Path(argv[0]).name == "dockerd"


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def discover(url: str | None = None, prefix: str = "VLLM::", title_filter: str = "",
             processes: Iterable[psutil.Process] | None = None, container: str = "",
             runner: Runner = run_argv, fs: ProcFS | None = None, anywhere: bool = True) -> list[EngineProcess]:
    """The engine processes behind ``url`` (its listener and descendants; through Docker's proxy), else in the
    named ``container`` (its init pid's descendants), else every titled one on the host (``anywhere``). A down
    engine's (not ``anywhere``): else the server whose command line names the URL's port, else none (another
    engine's titles are not its own)."""
    found: list[EngineProcess] = []
    root = engine_root(url, container, runner, fs) if (url or container) and processes is None else None
    if root is None and not anywhere and url and processes is None and (tree := server_for_port(url)) is not None:
        root = tree.pid, True  # its port closed: the server found by its command line, and what is left under it
    if root is not None:
        root_pid, is_server = root
        for proc in _tree(root_pid):
            desc = _describe(proc, prefix)
            if desc is None and (proc.pid == root_pid if is_server else
                                 not any(p.role == Role.API_SERVER for p in found) and is_server_argv(_cmd(proc))):
                desc = EngineProcess(proc.pid, Role.API_SERVER, "", {}, None)
            if desc is not None:
                found.append(desc)
        if not any(p.role in ENGINE_ROLES for p in found):
            log.info("the engine's root for %s (pid %d) has no engine processes under it", url or container, root_pid)
        return _filtered(found, title_filter)
    if not anywhere and processes is None:
        return []
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


def _cmd(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def is_server_argv(cmdline: Sequence[str]) -> bool:
    """A vLLM API server's command line (``python -m vllm.entrypoints...`` or ``vllm serve``)."""
    return any(a.startswith("vllm.entrypoints") for a in cmdline) or (
        len(cmdline) >= 2 and Path(cmdline[0]).name == "vllm" and cmdline[1] == "serve")


def _serves_port(cmdline: list[str], port: int | None) -> bool:
    """A vLLM API server for this port (``port`` None: any port)."""
    if not is_server_argv(cmdline):
        return False
    if port is None:
        return True
    for i, arg in enumerate(cmdline):
        if arg == "--port" and i + 1 < len(cmdline):
            return cmdline[i + 1] == str(port)
        if arg.startswith("--port="):
            return arg.split("=", 1)[1] == str(port)
    return port == 8000  # vLLM's default port


def server_for_port(url: str, processes: Iterable[psutil.Process] | None = None, port: int | None = 0,
                    within: Callable[[int], bool] | None = None) -> ServerTree | None:
    """The vLLM server that will listen on the URL's port, even before it binds it (it loads weights first).

    Found by command line (``vllm serve``/``api_server`` with ``--port``), so it works while the port is closed.
    ``port``: the port its command line must name (0: the URL's; None: any); ``within``: which pids may be it.
    """
    want = url_port(url) if port == 0 else port
    for proc in processes if processes is not None else psutil.process_iter():
        try:
            if within is not None and not within(proc.pid):
                continue
            cmdline = proc.cmdline()
            if not cmdline or cmdline[0].startswith("VLLM::") or not _serves_port(cmdline, want):
                continue
            started = proc.create_time()
            titles = tuple(sorted({t.split(" ", 1)[0] for t in map(title_of, proc.children(recursive=True))
                                   if t.startswith("VLLM::")}))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        return ServerTree(proc.pid, started, titles)
    return None


def server_for_url(url: str, container: str = "", runner: Runner = run_argv,
                   fs: ProcFS | None = None) -> ServerTree | None:
    """`server_for_port` for a URL that may lead into a container (docs/docker.md): when the URL's listener is
    docker-proxy, the server naming its container port in another network namespace; when nothing listens and
    ``container`` is named, any vLLM server among that container's processes; otherwise as `server_for_port`."""
    pid = listener_pid(url)
    if pid is not None:
        target = parse_docker_proxy(_argv(pid))
        if target is not None:
            procfs = fs or ProcFS()
            own = procfs.netns(pid)
            return server_for_port(url, port=target.container_port,
                                   within=lambda p: procfs.netns(p) not in (None, own))
    elif container:
        init, why = INIT_PIDS(container, runner, WATCH_INSPECT_TIMEOUT)
        if init is not None:
            pids = {p.pid for p in _tree(init)}
            return server_for_port(url, port=None, within=pids.__contains__)
        log.debug("server for %s: %s", url, why)
    return server_for_port(url)
