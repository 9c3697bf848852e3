"""A process's ``/proc/PID/stat`` line, parsed once for everyone who reads it: its state, parent, CPU used, threads
and start time.

The line is ``PID (COMM) STATE PPID ...``; ``comm`` is the process's name as it set it, up to 15 bytes of anything,
spaces and parentheses included (``(a) b)``), so the fields are counted from the last ``)``. `parse_stat` takes the
text; `read_stat` reads it (None when the process is gone or the line cannot be read). The start time, with the
pid, names one process: a pid reused by another has another start time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")  # the clock ticks per second that utime, stime and starttime count


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    comm: str
    state: str  # one letter: R running, S sleeping, D disk sleep, T stopped, t traced, Z zombie, ...
    ppid: int
    utime: int  # clock ticks in user mode, every thread
    stime: int  # clock ticks in the kernel, every thread
    num_threads: int
    starttime: int  # clock ticks after boot when it started

    @property
    def cpu_seconds(self) -> float:
        return (self.utime + self.stime) / CLK_TCK


def parse_stat(text: str) -> ProcStat:
    """The fields of one ``/proc/PID/stat`` line; ValueError when it is not one."""
    head, sep, tail = text.rpartition(")")
    pid, paren, comm = head.partition(" (")
    f = tail.split()
    try:
        if not sep or not paren or len(f) < 20:
            raise ValueError("too few fields")
        return ProcStat(int(pid), comm, f[0], int(f[1]), int(f[11]), int(f[12]), int(f[17]), int(f[19]))
    except ValueError as e:
        raise ValueError(f"not a /proc/PID/stat line ({e}): {text[:80]!r}") from None


def read_stat(pid: int, proc: str | Path = "/proc") -> ProcStat | None:
    """``pid``'s stat under ``proc`` (a fake tree in the tests); None when it is gone or its line unreadable."""
    try:
        return parse_stat((Path(proc) / str(pid) / "stat").read_text(errors="replace"))
    except (OSError, ValueError):
        return None
