"""Which processes on a node are the engine's: more than a title, which any local user can give any process
(``exec -a VLLM::Worker_TP1 sleep 300``).

A process whose title is the engine's is taken only if one of these holds (`Identity`, from the agent's config):

- its owner is one of ``engine_users`` (real, effective, saved and filesystem uid all; ``root`` by default: a
  setuid program started by a user keeps that user's real uid and is not taken);
- it runs in one of ``engine_units``, a systemd system unit (its cgroup ``/<slices>/<unit>``, below the root of
  PID 1's cgroup, as systemd itself reads it; a unit of a user's own systemd lies under ``user@UID.service`` and never
  matches), the units of the node's systemd steps and its ``journal_unit`` included;
- it runs in one of ``engine_containers``, a Docker container by name (resolved with ``docker inspect``) or id
  (``/docker/<id>`` or ``docker-<id>.scope``), the containers of its docker steps and its ``docker_container``
  included;
- its cgroup lies under one of ``engine_cgroups`` (another runtime: ``/kubepods.slice/``).

Only root can put a process in a system unit's or a container's cgroup, or give it uid 0. The checks read
``/proc/PID/stat`` (its start time) before and after ``status``, ``cgroup`` and the command line, so what was read
belongs to one process, not a pid reused in between. The parsing (`cgroup_paths`, `unit_in`, `docker_id_in`,
`verdict`) takes text and gives verdicts; `EngineIdentity` does the reading.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from watchdog.host import docker_cli
from watchdog.host.proc_stat import read_stat

UNIT = re.compile(r"^[A-Za-z0-9:_.\\@-]{1,240}\.(service|scope)$")
CONTAINER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
HEX_ID = re.compile(r"^[0-9a-f]{12,64}$")
_UNIT_PATH = re.compile(r"^/(?:[^/]+\.slice/)*([^/]+\.(?:service|scope))(?:/|$)")
_DOCKER_PATHS = (re.compile(r"^/(?:[^/]+\.slice/)*docker-([0-9a-f]{64})\.scope(?:/|$)"),
                 re.compile(r"^/docker/([0-9a-f]{64})(?:/|$)"))
RESOLVE_EVERY = 60.0  # seconds a container name's id is kept before docker is asked again


@dataclass(frozen=True, slots=True)
class Identity:
    uids: frozenset[int]
    units: tuple[str, ...] = ()
    containers: tuple[str, ...] = ()  # names or ids (12 to 64 hex digits)
    cgroups: tuple[str, ...] = ()

    def say(self) -> str:
        """The rule in words, for the answers and the docs."""
        parts = [f"owned by uid {', '.join(map(str, sorted(self.uids)))}" if self.uids else "",
                 f"in unit {', '.join(self.units)}" if self.units else "",
                 f"in container {', '.join(self.containers)}" if self.containers else "",
                 f"under cgroup {', '.join(self.cgroups)}" if self.cgroups else ""]
        return " or ".join(p for p in parts if p) or "nothing (no engine process can be taken)"


def unit_name(unit: str) -> str:
    """systemctl's reading of a bare name: ``vllm-worker`` is ``vllm-worker.service``."""
    return unit if unit.endswith((".service", ".scope")) else f"{unit}.service"


def check_identity(i: Identity) -> str:
    """"" when the rule is well formed, else what is wrong."""
    for u in i.units:
        if not UNIT.match(unit_name(u)):
            return f"engine_units: {u!r} is not a systemd unit name"
    for c in i.containers:
        if not CONTAINER.match(c):
            return f"engine_containers: {c!r} is not a container name or id"
    for g in i.cgroups:
        if not g.startswith("/") or g == "/" or "/../" in f"{g}/":
            return f"engine_cgroups: {g!r} must be an absolute cgroup path below the root"
    return ""


def _lines(text: str) -> dict[str, str]:
    """hierarchy (``9:name=systemd``, ``0:``) -> path, from a /proc/PID/cgroup."""
    out = {}
    for line in text.splitlines():
        hier, sep, path = line.rpartition(":")
        if sep and path.startswith("/"):
            out[hier] = path
    return out


def cgroup_paths(text: str, init_text: str) -> list[str]:
    """A process's cgroup paths, one per hierarchy, as seen from the root systemd uses (PID 1's cgroup without its
    ``/init.scope``); a path outside that root is dropped (it cannot be a system unit's)."""
    init = _lines(init_text)
    out = []
    for hier, path in _lines(text).items():
        root = init.get(hier, "/").removesuffix("/init.scope") or "/"
        if root == "/":
            out.append(path)
        elif path == root or path.startswith(root + "/"):
            out.append(path[len(root):] or "/")
    return out


def unit_in(path: str) -> str:
    """The system unit a cgroup path lies in ("" when none: a user's own units lie under user@UID.service)."""
    m = _UNIT_PATH.match(path)
    return m.group(1) if m else ""


def docker_id_in(path: str) -> str:
    for pat in _DOCKER_PATHS:
        m = pat.match(path)
        if m:
            return m.group(1)
    return ""


def verdict(uids: Iterable[int], paths: list[str], rule: Identity,
            container_ids: Callable[[str], set[str]]) -> str:
    """"" when a process with these uids and cgroup paths is the engine's by ``rule``, else why not.
    ``container_ids(name)``: the ids a container name has now (asked only when a path lies in a container)."""
    uids = set(uids)
    if uids and uids <= rule.uids:
        return ""
    units = {unit_name(u) for u in rule.units}
    for path in paths:
        if unit_in(path) in units:
            return ""
        if any(path == g.rstrip("/") or path.startswith(g.rstrip("/") + "/") for g in rule.cgroups):
            return ""
        cid = docker_id_in(path)
        if cid and any(cid.startswith(c) if HEX_ID.match(c) else cid in container_ids(c) for c in rule.containers):
            return ""
    where = next((p for p in paths if p != "/"), "/")
    return f"not the engine's: uid {'/'.join(map(str, sorted(uids)))}, cgroup {where} (this node takes {rule.say()})"


class EngineIdentity:
    """`verdict` on live processes: reads /proc, asks docker for a container name's id (cached)."""

    def __init__(self, rule: Identity, proc: str = "/proc", runner: docker_cli.Runner = docker_cli.run_docker,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rule, self.proc, self.runner, self.clock = rule, Path(proc), runner, clock
        self._ids: dict[str, tuple[float, set[str]]] = {}

    def container_ids(self, name: str) -> set[str]:
        got = self._ids.get(name)
        if got is not None and self.clock() - got[0] < RESOLVE_EVERY:
            return got[1]
        cid, _ = docker_cli.container_id(name, self.runner, 5.0)
        ids = {cid} if cid else set()
        self._ids[name] = (self.clock(), ids)
        return ids

    def check(self, pid: int, title: str) -> str:
        """"" when pid (titled ``title`` when found) is the engine's; else why not (gone, changed, not the engine's)."""
        base = self.proc / str(pid)
        try:
            started = read_stat(pid, self.proc)
            status = (base / "status").read_text(errors="replace")
            cgroup = (base / "cgroup").read_text(errors="replace")
            init = (self.proc / "1" / "cgroup").read_text(errors="replace")
            cmdline = (base / "cmdline").read_bytes()
            again = read_stat(pid, self.proc)
        except OSError:
            return "gone, or /proc unreadable"
        if started is None or again is None:
            return "gone, or /proc unreadable"
        if again.starttime != started.starttime:
            return "gone: its pid was reused while it was read"
        if not title or not cmdline.replace(b"\0", b" ").decode(errors="replace").startswith(title):
            return "its title changed while it was read"
        uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
        return verdict((int(u) for u in uids), cgroup_paths(cgroup, init), self.rule, self.container_ids)
