"""PyTorch's NCCL Flight Recorder, read: is it on in a process, what did each rank last enter. Pure.

A process records its torch.distributed collectives when started with ``TORCH_FR_BUFFER_SIZE`` (older name
``TORCH_NCCL_TRACE_BUFFER_SIZE``) > 0; it dumps them on demand when ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is set
(a line written to the FIFO ``<that prefix><rank>.pipe``, seen on torch 2.11) to ``TORCH_FR_DUMP_TEMP_FILE<rank>``
(older ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default ``/tmp/nccl_trace_rank_``). Here: those settings read from an
environment, and a decoded dump summarised per rank and across ranks. Decoding a dump's bytes (a pickle) is
`watchdog.evidence.gpu.fr_dump`; triggering and reading the dumps is `watchdog.evidence.gpu.fr_trigger`.

vLLM's own PyNccl wrapper calls NCCL directly for its model collectives: the recorder never sees those, only
what goes through torch.distributed's ProcessGroupNCCL. A recorder with no collective entries says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"  # noqa: S108 - torch's own default, read, never written by us
BYPASS_NOTE = ("the Flight Recorder recorded no collective: vLLM's PyNccl wrapper (and custom all-reduce) call "
               "NCCL directly and bypass torch.distributed, so the recorder cannot see the model's collectives")


@dataclass(frozen=True, slots=True)
class FrConfig:
    buffer_size: int  # entries; 0: the recorder is off
    pipe_prefix: str  # "" : no dump pipe
    dump_prefix: str
    problems: tuple[str, ...] = ()

    @property
    def can_dump(self) -> bool:
        return self.buffer_size > 0 and bool(self.pipe_prefix)

    def pipe_path(self, rank: int) -> str:
        return f"{self.pipe_prefix}{rank}.pipe"

    def dump_path(self, rank: int) -> str:
        return f"{self.dump_prefix}{rank}"


def parse_environ(data: bytes) -> dict[str, str]:
    """/proc/PID/environ: NUL-separated NAME=value."""
    env = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def fr_config(env: Mapping[str, str]) -> FrConfig:
    def first(*names: str) -> str:
        return next((env[n] for n in names if env.get(n)), "")

    problems = []
    raw = first("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    try:
        size = int(raw) if raw else 0
    except ValueError:
        size, raw = 0, ""
        problems.append("TORCH_FR_BUFFER_SIZE is not a number")
    if size <= 0:
        problems.append("the Flight Recorder is off (TORCH_FR_BUFFER_SIZE unset or 0 in /proc/PID/environ; a process "
                        "titled with setproctitle, as vLLM's are, may have had its environ overwritten: start the "
                        "engine with SPT_NOENV=1, or set gpu.fr_pipe_prefix and gpu.fr_dump_prefix)")
    pipe = first("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    if not pipe:
        problems.append("no dump pipe (TORCH_NCCL_DEBUG_INFO_PIPE_FILE unset): the recorder cannot be asked to dump")
    dump = first("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or DEFAULT_DUMP_PREFIX
    return FrConfig(size, pipe, dump, tuple(problems))


@dataclass(frozen=True, slots=True)
class FrEntry:
    seq: int | None  # collective_seq_id
    pg: str
    name: str  # profiling_name, e.g. nccl:all_reduce
    state: str  # scheduled, started, completed
    sizes: str
    created_ns: int | None


@dataclass(frozen=True, slots=True)
class FrSummary:
    rank: int
    entries: int
    version: str = ""
    last_entered: FrEntry | None = None  # the newest collective this rank entered
    first_unfinished: FrEntry | None = None  # the oldest one not completed: where it waits
    pg_status: dict[str, dict[str, int]] = field(default_factory=dict)
    note: str = ""

    def line(self) -> str:
        if self.last_entered is None:
            return f"rank {self.rank}: {self.note or 'no collective recorded'}"
        e = self.last_entered
        waits = self.first_unfinished
        tail = (f"; waits in #{waits.seq} {waits.name} ({waits.state})" if waits and waits is not e
                else "")
        return f"rank {self.rank}: last entered #{e.seq} {e.name} on pg {e.pg} {e.sizes}: {e.state}{tail}"


def _entry(raw: Mapping[str, Any]) -> FrEntry:
    seq = raw.get("collective_seq_id")
    created = raw.get("time_created_ns")
    pg = raw.get("process_group")
    pg_name = "/".join(str(x) for x in pg) if isinstance(pg, list | tuple) else str(raw.get("pg_id", ""))
    return FrEntry(seq if isinstance(seq, int) else None, pg_name, str(raw.get("profiling_name", "?")),
                   str(raw.get("state", "?")), str(raw.get("input_sizes", "")),
                   created if isinstance(created, int) else None)


def summarize(dump: Mapping[str, Any], rank: int) -> FrSummary:
    raw_entries = dump.get("entries") or []
    entries = [_entry(e) for e in raw_entries if isinstance(e, dict)]
    status: dict[str, dict[str, int]] = {}
    for pg, st in (dump.get("pg_status") or {}).items():
        if isinstance(st, dict):
            status[str(pg)] = {str(k): v for k, v in st.items() if isinstance(v, int)}
    version = str(dump.get("version", ""))
    if not entries:
        return FrSummary(rank, 0, version, pg_status=status, note=BYPASS_NOTE)
    coll = [e for e in entries if e.seq is not None] or entries
    last = max(coll, key=lambda e: (e.seq or 0, e.created_ns or 0))
    unfinished = [e for e in coll if e.state != "completed"]
    first = min(unfinished, key=lambda e: (e.seq or 0, e.created_ns or 0)) if unfinished else None
    return FrSummary(rank, len(entries), version, last, first, status)


def cross_rank_fr(summaries: Sequence[FrSummary]) -> str:
    """One sentence over every rank's recorder: who lags, or where they all wait. Pure."""
    seen = [s for s in summaries if s.last_entered is not None]
    if not summaries:
        return ""
    if not seen:
        return BYPASS_NOTE
    seqs = {s.rank: s.last_entered.seq or 0 for s in seen if s.last_entered}
    top = max(seqs.values())
    behind = sorted(r for r, q in seqs.items() if q < top)
    if behind:
        return (f"rank(s) {', '.join(map(str, behind))} never entered collective #{top} that the others entered: "
                "they are the ones that stopped")
    waiting = [s for s in seen if s.first_unfinished is not None]
    names = {s.last_entered.name for s in seen if s.last_entered}
    if len(names) > 1:
        return f"every rank entered #{top} but under different operations ({', '.join(sorted(names))}): a mismatch"
    if waiting and len(waiting) == len(seen):
        w = waiting[0].first_unfinished
        assert w is not None
        return f"every rank entered #{top} and none finished #{w.seq} {w.name}: they wait together (on the device)"
    if waiting:
        return (f"rank(s) {', '.join(str(s.rank) for s in waiting)} have unfinished collectives; the others "
                f"finished #{top}")
    return f"every rank finished its last recorded collective #{top}: the hang is not in a recorded collective"
