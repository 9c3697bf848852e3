"""Shared-memory segments an engine leaves in /dev/shm (``psm_*`` from torch/vLLM's shared memory, ``sem.mp-*``
from multiprocessing semaphores). A segment no process has open or mapped is stale: a SIGKILLed engine's leftovers,
memory the next start cannot use on a unified-memory machine."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

PATTERNS = ("psm_", "sem.mp-")


@dataclass(frozen=True, slots=True)
class Segment:
    name: str
    path: str
    size: int
    stale: bool


def _in_use(shm_dir: str) -> set[str]:
    """Paths under ``shm_dir`` some process has open or mapped (every /proc entry we may read)."""
    prefix = shm_dir.rstrip("/") + "/"
    used: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    used.add(target.removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue
    return used


def shm_segments(shm_dir: str = "/dev/shm") -> list[Segment]:  # noqa: S108 - POSIX shared memory
    try:
        names = sorted(n for n in os.listdir(shm_dir) if n.startswith(PATTERNS))
    except FileNotFoundError:  # no /dev/shm here: nothing left in it (any other OSError is raised: cannot tell)
        return []
    used = _in_use(shm_dir) if names else set()
    out = []
    for n in names:
        path = str(Path(shm_dir) / n)
        try:
            st = os.lstat(path)  # a link named psm_* is not a segment: never followed, never removed
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append(Segment(n, path, st.st_size, path not in used))
    return out


def remove_stale(segments: list[Segment]) -> tuple[list[Segment], list[tuple[Segment, str]]]:
    """Remove the stale segments: (removed, [(not removed, why)])."""
    removed, failed = [], []
    for s in segments:
        if not s.stale:
            continue
        try:
            os.unlink(s.path)
            removed.append(s)
        except OSError as e:
            failed.append((s, e.strerror or str(e)))
    return removed, failed
