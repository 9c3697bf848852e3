"""Asking every rank's Flight Recorder to dump, on a freeze, before anything is restarted: the I/O.

For each engine process: read ``/proc/PID/environ`` for the recorder's settings; write a line to its dump pipe
(``<pipe prefix><rank>.pipe``, opened non-blocking, so a pipe nobody reads never blocks us), then wait at most
``settle`` seconds for each rank's dump file to appear (newer than the trigger) and load. What could not be had
is said per rank.

Both paths come from the engine's environment, which the engine's user writes: the pipe is written only if it is a
FIFO and the dump read only if it is a regular file with one link, each reached without a symbolic link and owned
by one of that process's uids, the dump capped in bytes (`watchdog.host.files`). A link to ``/etc/passwd`` where
the pipe should be is never written; a link to root's files, or a FIFO, where the dump should be is never read.
A process in another mount namespace (a container) names paths in its own filesystem: they are reached under its
``/proc/PID/root`` (`watchdog.host.ns_paths`), no link leading out of it.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from watchdog.evidence.gpu.flight_recorder import FrConfig, fr_config, parse_environ
from watchdog.evidence.gpu.fr_dump import MAX_DUMP_BYTES, DumpError, load_dump
from watchdog.host.files import UnsafeFile, list_dir, lstat_at, read_capped, write_fifo
from watchdog.host.ns_paths import root_of

MAX_RANKS = 1024  # dump pipes followed per process's prefix, at most


def config_of(pid: int) -> FrConfig | None:
    """The recorder's settings in a process's environment; None when /proc cannot be read."""
    try:
        return fr_config(parse_environ(Path(f"/proc/{pid}/environ").read_bytes()))
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class FrRank:
    rank: int
    pid: int | None
    pipe: str
    dump: str
    data: bytes  # the dump as written ("" when none came)
    error: str
    seconds: float  # from the trigger to the dump being readable


@dataclass(frozen=True, slots=True)
class FrTrigger:
    ranks: tuple[FrRank, ...]
    problems: tuple[str, ...]
    seconds: float  # trigger and settle, in all


def _write_pipe(path: str, owners: frozenset[int] | None, root: str | None = None) -> str:
    """"" when written; else why not. Never blocks, and writes to nothing but a FIFO its process owns: the path
    comes from the engine's environment, which its user sets (a link to /etc/passwd there is refused unwritten)."""
    try:
        write_fifo(path, b"1\n", owners, root)
    except UnsafeFile as e:
        return str(e)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return f"{path}: nobody reads the pipe (the process's NCCL monitor thread is gone?)"
        return f"{path}: {e.strerror}"
    return ""


def uids_of(pid: int) -> frozenset[int] | None:
    """The uids (real, effective, saved, filesystem) a process runs with: who may own its pipe and its dumps."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return frozenset(int(u) for u in line.split()[1:])
    except (OSError, ValueError):
        pass
    return None


def _ranks_of_pipes(prefix: str, root: str | None = None) -> list[int]:
    """The ranks whose pipe ``<prefix><rank>.pipe`` is in the prefix's directory (under ``root``)."""
    directory, start = os.path.split(prefix)
    pat = re.compile(re.escape(start) + r"(\d{1,6})\.pipe$")
    try:
        names = list_dir(directory or ".", root)
    except OSError:  # UnsafeFile included: no pipe is followed through a link out of the root
        return []
    return sorted(int(m.group(1)) for n in names if (m := pat.match(n)))[:MAX_RANKS]


def trigger(pids: Sequence[int], ranks: Mapping[int, int] | None = None, settle: float = 10.0,
            configs: Mapping[int, FrConfig | None] | None = None, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> FrTrigger:
    """Dump every rank's recorder now; returns within ``settle`` s (plus the pipe writes)."""
    t0 = clock()
    problems: list[str] = []
    targets: dict[int, tuple[int | None, FrConfig]] = {}  # rank -> (pid, its config)
    owners: dict[int, frozenset[int] | None] = {}  # rank -> who may own its pipe and dump (its process's uids)
    roots: dict[int, str | None] = {}  # rank -> its process's root when in another mount namespace
    for pid in pids:
        cfg = configs[pid] if configs is not None and pid in configs else config_of(pid)
        if cfg is None:
            problems.append(f"pid {pid}: its environment cannot be read")
            continue
        if not cfg.can_dump:
            problems.extend(f"pid {pid}: {p}" for p in cfg.problems)
            continue
        known = (ranks or {}).get(pid)
        root = root_of(pid)
        found = [known] if known is not None else _ranks_of_pipes(cfg.pipe_prefix, root)
        if not found:  # configured, yet torch made no pipe: say so (seen with torch 2.11 on an H200)
            where = f" under {root}" if root else ""
            problems.append(f"pid {pid}: the recorder is on, but no pipe {cfg.pipe_prefix}<rank>.pipe exists{where}: "
                            "torch makes it only in a process that created an NCCL communicator with the pipe "
                            "setting in its environment at start")
        uids = uids_of(pid)
        for rank in found:
            if rank not in targets:
                targets[rank] = (pid if known is not None else None, cfg)
                owners[rank] = uids
                roots[rank] = root
    if not targets:
        return FrTrigger((), tuple(dict.fromkeys(problems)), round(clock() - t0, 3))
    before: dict[int, float] = {}
    errors: dict[int, str] = {}
    for rank, (_, cfg) in targets.items():
        try:
            before[rank] = lstat_at(cfg.dump_path(rank), roots[rank]).st_mtime_ns
        except OSError:
            before[rank] = -1
        errors[rank] = _write_pipe(cfg.pipe_path(rank), owners[rank], roots[rank])
    got: dict[int, tuple[bytes, float]] = {}
    unreadable: dict[int, str] = {}  # rank -> why its newest dump could not be decoded
    waiting = {r for r in targets if not errors[r]}
    while waiting and clock() - t0 < settle:
        sleep(0.1)
        for rank in list(waiting):
            path = targets[rank][1].dump_path(rank)
            try:
                if lstat_at(path, roots[rank]).st_mtime_ns == before[rank]:
                    continue
                data = read_capped(path, MAX_DUMP_BYTES, owners[rank], roots[rank])
                load_dump(data)
            except UnsafeFile as e:
                errors[rank] = f"{e}: not read"
                waiting.discard(rank)
                continue
            except (OSError, DumpError) as e:
                unreadable[rank] = f"{e}" if isinstance(e, DumpError) else ""
                continue  # not there yet, or still being written
            except Exception as e:  # a hostile dump costs its rank, never the other ranks
                unreadable[rank] = f"unreadable dump ({type(e).__name__})"
                continue
            got[rank] = (data, round(clock() - t0, 3))
            waiting.discard(rank)
    out = []
    for rank, (owner, cfg) in sorted(targets.items()):
        data, secs = got.get(rank, (b"", 0.0))
        err = errors[rank] or ("" if rank in got else f"no readable dump at {cfg.dump_path(rank)} within {settle:g}s"
                                + (f" ({unreadable[rank]})" if unreadable.get(rank) else ""))
        out.append(FrRank(rank, owner, cfg.pipe_path(rank), cfg.dump_path(rank), data, err, secs))
    return FrTrigger(tuple(out), tuple(dict.fromkeys(problems)), round(clock() - t0, 3))
