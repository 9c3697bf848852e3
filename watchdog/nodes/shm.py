"""Shared-memory segments an engine leaves in /dev/shm (``psm_*`` from torch/vLLM's shared memory, ``sem.mp-*``
from multiprocessing semaphores). A segment no process has open or mapped is stale: a SIGKILLed engine's leftovers,
memory the next start cannot use on a unified-memory machine.

An engine in a container has its own ``/dev/shm`` (unless ``--ipc=host``): given ``root`` (its ``/proc/PID/root``,
`watchdog.host.ns_paths`) the directory is listed and its segments removed under that root, never through a link
out of it. Whether a segment is in use is told by its device and inode, which every process's ``fd`` and ``maps``
show whatever mount namespace it sees the segment from."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from watchdog.host.files import list_dir, lstat_at, unlink_at
from watchdog.host.ns_paths import host_path

PATTERNS = ("psm_", "sem.mp-")


@dataclass(frozen=True, slots=True)
class Segment:
    name: str
    path: str  # the host's name for it (under the root when there is one)
    size: int
    stale: bool
    where: str = ""  # the path as its engine names it (``shm_dir/name``)
    root: str | None = None  # its engine's root when in another mount namespace


def _in_use(*dirs: str) -> set[tuple[int, int]]:
    """(device, inode) of the files under any of ``dirs`` (as each process names them: its own ``/dev/shm``, or
    the host's name for the container's) that some process has open or mapped (every /proc entry we may read)."""
    prefixes = tuple(d.rstrip("/") + "/" for d in dirs)
    used: set[tuple[int, int]] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefixes):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        used.add((st.st_dev, st.st_ino))
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    if any(p in line for p in prefixes):
                        f = line.split()
                        try:
                            major, minor = (int(x, 16) for x in f[3].split(":"))
                            used.add((os.makedev(major, minor), int(f[4])))
                        except (IndexError, ValueError):
                            continue
        except OSError:
            continue
    return used


def shm_segments(shm_dir: str = "/dev/shm", root: str | None = None) -> list[Segment]:  # noqa: S108 - POSIX shm
    """The segments in ``shm_dir`` (under ``root``: another mount namespace's)."""
    try:
        names = sorted(n for n in list_dir(shm_dir, root) if n.startswith(PATTERNS))
    except FileNotFoundError:  # no /dev/shm here: nothing left in it (any other OSError is raised: cannot tell)
        return []
    used = _in_use(*dict.fromkeys([shm_dir, host_path(shm_dir, root)])) if names else set()
    out = []
    for n in names:
        where = os.path.join(shm_dir, n)
        try:
            st = lstat_at(where, root)  # a link named psm_* is not a segment: never followed, never removed
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append(Segment(n, host_path(where, root), st.st_size, (st.st_dev, st.st_ino) not in used, where,
                               root))
    return out


def remove_segment(s: Segment) -> None:
    """Unlink one segment from its directory, reached as it was listed (no link followed). Raises OSError."""
    unlink_at(s.where or s.path, s.root)


def remove_stale(segments: list[Segment]) -> tuple[list[Segment], list[tuple[Segment, str]]]:
    """Remove the stale segments: (removed, [(not removed, why)])."""
    removed, failed = [], []
    for s in segments:
        if not s.stale:
            continue
        try:
            remove_segment(s)
            removed.append(s)
        except OSError as e:
            failed.append((s, e.strerror or str(e)))
    return removed, failed
