"""Read the broadcast ring's flags: which blocks EngineCore wrote, which each local worker read (docs/ring.md).

`read_rings(processes, version)`: for each EngineCore of this node among ``processes``, the ``psm_*`` segments of
``/dev/shm`` that it and its workers map (``/proc/PID/maps``: device and inode). The broadcast ring is the one
mapped by EngineCore and ``n`` workers whose size fits the version's layout with ``n`` local readers
(`watchdog.evidence.explain.ring_layout`); a worker's response ring (EngineCore and that worker, one reader,
24 MiB chunks) is told apart by its shape. Only the flag bytes are read: the segment is opened ``O_RDONLY`` (under
``/proc/PID/root`` for a container, no link followed: `watchdog.host.files`), checked to be the mapped inode, and
read with one ``pread`` at the metadata's offset; it is never mapped, never written. Every failure is a
``Ring(error=...)``, never an exception. An EngineCore with no worker process (the one-process executor) has no
ring: nothing is said of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from watchdog.core.processes import EngineProcess
from watchdog.core.ring import Ring
from watchdog.core.roles import Role, title_in
from watchdog.evidence.collect.context import installed_versions
from watchdog.evidence.explain.ring_layout import Layout, layout_for, ring_error, ring_of, version_refusal
from watchdog.host.files import open_checked
from watchdog.host.ns_paths import root_of

SHM_DIR = "/dev/shm"  # noqa: S108 - POSIX shared memory, where SharedMemory puts psm_*
MAX_MAPS_BYTES = 32 * 1024 * 1024  # a process's maps read at most (a big engine's is a few MiB)
MAX_CANDIDATES = 64  # segments shared by EngineCore and a worker, opened at most
NOT_FOUND = "no broadcast ring mapped by EngineCore and its workers"

Key = tuple[int, int]  # (device, inode)


@dataclass(frozen=True, slots=True)
class Mapped:
    path: str  # as the process names it (/dev/shm/psm_...)
    deleted: bool


def mapped_segments(pid: int, proc: str = "/proc", shm_dir: str = SHM_DIR) -> dict[Key, Mapped]:
    """The ``psm_*`` files of ``shm_dir`` that process ``pid`` maps, by (device, inode). Raises OSError."""
    prefix = shm_dir.rstrip("/") + "/psm_"
    out: dict[Key, Mapped] = {}
    got = 0
    with open(f"{proc}/{pid}/maps", "rb") as maps:
        for raw in maps:
            got += len(raw)
            if got > MAX_MAPS_BYTES:
                raise OSError(f"{proc}/{pid}/maps holds more than {MAX_MAPS_BYTES} bytes")
            if prefix.encode() not in raw:
                continue
            f = raw.decode("utf-8", "replace").rstrip("\n").split(None, 5)
            if len(f) < 6 or not f[5].startswith(prefix):
                continue
            try:
                major, minor = (int(x, 16) for x in f[3].split(":"))
                key = (os.makedev(major, minor), int(f[4]))
            except ValueError:
                continue
            path, deleted = f[5], f[5].endswith(" (deleted)")
            out.setdefault(key, Mapped(path.removesuffix(" (deleted)"), deleted))
    return out


def _why(e: OSError) -> str:
    if isinstance(e, PermissionError):
        return f"denied ({e.strerror or e})"
    if isinstance(e, FileNotFoundError | ProcessLookupError):
        return "gone"
    return str(e) if not e.strerror else e.strerror


def _reader_order(workers: Sequence[EngineProcess]) -> tuple[EngineProcess, ...] | None:
    """The workers in local reader rank order (their global rank: PP-major, TP-minor), or None when their titles
    cannot tell it (two with the same ranks)."""
    keys = [(w.ranks.get("PP", 0), w.ranks.get("TP", 0)) for w in workers]
    if len(set(keys)) != len(keys):
        return None
    return tuple(w for _, w in sorted(zip(keys, workers, strict=True), key=lambda kw: kw[0]))


def _name(p: EngineProcess) -> str:
    return title_in(p.title) or p.label


def _open_read(core: EngineProcess, key: Key, where: Mapped, layout_of: int,
               version: str, proc: str) -> tuple[Layout | str, bytes]:
    """(its layout or why none, the metadata bytes): the segment opened read-only as ``core`` names it."""
    root = root_of(core.pid, proc)
    with open_checked(where.path, os.O_RDONLY, root=root) as fd:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != key:
            raise OSError(f"{where.path} is no longer the segment EngineCore maps (replaced)")
        layout = layout_for(st.st_size, layout_of, version)
        if isinstance(layout, str):
            return layout, b""
        return layout, os.pread(fd, layout.metadata_size, layout.metadata_offset)


def read_ring(core: EngineProcess, workers: Sequence[EngineProcess], version: str, t: float = 0.0,
              proc: str = "/proc") -> Ring:
    """The broadcast ring that ``core`` (an EngineCore of this host) writes and ``workers`` read, or why not."""
    writer = _name(core)
    why = version_refusal(version)
    if why:
        return ring_error(why, writer=writer, version=version, t=t)
    try:
        mine = mapped_segments(core.pid, proc)
    except OSError as e:
        return ring_error(f"maps of {writer} (pid {core.pid}) not readable: {_why(e)}", writer=writer,
                          version=version, t=t)
    theirs: dict[int, dict[Key, Mapped]] = {}
    notes = []
    for w in workers:
        try:
            theirs[w.pid] = mapped_segments(w.pid, proc)
        except OSError as e:
            notes.append(f"maps of {_name(w)} not readable: {_why(e)}")
    shared = [(k, m, [w for w in workers if k in theirs.get(w.pid, {})]) for k, m in mine.items()]
    shared = sorted((s for s in shared if s[2]), key=lambda s: -len(s[2]))[:MAX_CANDIDATES]
    fits: list[tuple[Mapped, Layout, bytes, list[EngineProcess]]] = []
    for key, where, mappers in shared:
        if where.deleted:
            notes.append(f"{os.path.basename(where.path)} is deleted (a ring torn down)")
            continue
        try:
            layout, data = _open_read(core, key, where, len(mappers), version, proc)
        except OSError as e:
            notes.append(f"{os.path.basename(where.path)} not readable: {_why(e)}")
            continue
        if isinstance(layout, Layout) and not layout.response_shaped:
            fits.append((where, layout, data, mappers))
        elif isinstance(layout, str) and len(mappers) > 1:
            notes.append(f"{os.path.basename(where.path)}: {layout}")
    if not fits:
        detail = f" ({'; '.join(notes)})" if notes else ""
        return ring_error(NOT_FOUND + detail, writer=writer, version=version, t=t)
    most = max(len(f[3]) for f in fits)
    best = [f for f in fits if len(f[3]) == most]
    if len(best) > 1:
        names = ", ".join(os.path.basename(f[0].path) for f in best)
        return ring_error(f"{len(best)} segments fit the broadcast ring's layout ({names}): which one is it cannot "
                          "be told", writer=writer, version=version, t=t)
    where, layout, data, mappers = best[0]
    order = _reader_order(mappers)
    readers = tuple(_name(w) for w in order) if order is not None else ("",) * len(mappers)
    return ring_of(os.path.basename(where.path), layout, data, readers=readers, writer=writer, version=version,
                   t=t)


def read_rings(processes: Sequence[EngineProcess], version: str, t: float = 0.0,
               proc: str = "/proc") -> tuple[Ring, ...]:
    """The broadcast ring of each EngineCore of this host among ``processes`` that has local worker processes."""
    local = [p for p in processes if p.node == "local"]
    workers = [p for p in local if p.role == Role.WORKER]
    out = []
    for core in (p for p in local if p.role == Role.ENGINE_CORE):
        mine = [w for w in workers if w.ppid in (None, core.pid)] or workers
        mine = [w for w in mine if w.ranks.get("DP", core.ranks.get("DP", 0)) == core.ranks.get("DP", 0)]
        if not mine:
            continue
        try:
            out.append(read_ring(core, mine, version, t, proc))
        except Exception as e:  # evidence, never the investigation's end
            out.append(ring_error(f"reading failed: {type(e).__name__}: {str(e)[:200]}", writer=_name(core),
                                  version=version, t=t))
    return tuple(out)


def read_engine_rings(processes: Sequence[EngineProcess], t: float = 0.0, proc: str = "/proc") -> tuple[Ring, ...]:
    """`read_rings` with the engine's vLLM version read from its own site-packages (`context.installed_versions`:
    /proc and directory listings only, no subprocess)."""
    cores = [p.pid for p in processes if p.role == Role.ENGINE_CORE and p.node == "local"]
    if not cores or not any(p.role == Role.WORKER and p.node == "local" for p in processes):
        return ()
    try:
        version = installed_versions(cores, None, proc=proc).get("vllm", "")
    except Exception:  # the version's own reading failed: the ring says it was not known
        version = ""
    return read_rings(processes, version, t, proc)
