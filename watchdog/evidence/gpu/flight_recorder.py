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

MAX_TEXT = 200  # characters of any one field taken from a dump
_MAX_INT = 2**63  # a sequence number or a time beyond this is not torch's


class DumpError(Exception):
    """A Flight Recorder dump that cannot be read: undecodable bytes, or a decoded dict of the wrong shape."""

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
    problems: tuple[str, ...] = ()  # what in the dump was skipped, and why

    def line(self) -> str:
        if self.last_entered is None:
            return f"rank {self.rank}: {self.note or 'no collective recorded'}"
        e = self.last_entered
        waits = self.first_unfinished
        tail = (f"; waits in #{waits.seq} {waits.name} ({waits.state})" if waits and waits is not e
                else "")
        return f"rank {self.rank}: last entered #{e.seq} {e.name} on pg {e.pg} {e.sizes}: {e.state}{tail}"


def _int(x: object) -> int | None:
    return x if type(x) is int and -_MAX_INT < x < _MAX_INT else None


def _text(x: object, depth: int = 3) -> str:
    """A field of a dump as bounded, printable text, whatever it holds: nesting, huge numbers and control
    characters are cut, never followed (``str`` on a 100k-deep list or a 5000-digit int raises)."""
    if isinstance(x, str):
        out = "".join(c if c.isprintable() else "?" for c in x[:MAX_TEXT])
    elif x is None or isinstance(x, bool | float):
        out = repr(x)
    elif type(x) is int:
        out = str(x) if -_MAX_INT < x < _MAX_INT else "<int too large>"
    elif isinstance(x, list | tuple):
        if depth <= 0:
            return "[...]"
        items = [_text(v, depth - 1) for v in x[:16]]
        out = "[" + ", ".join(items) + (", ..." if len(x) > 16 else "") + "]"
    else:
        out = f"<{type(x).__name__}>"
    return out if len(out) <= MAX_TEXT else out[:MAX_TEXT - 3] + "..."


def _entry(raw: Mapping[Any, Any]) -> FrEntry | str:
    """One recorded collective, or why it is refused (a field of the wrong type)."""
    for key in ("profiling_name", "state"):
        if key in raw and not isinstance(raw[key], str):
            return f"{key} is a {type(raw[key]).__name__}, not text"
    seq = raw.get("collective_seq_id")
    if seq is not None and _int(seq) is None:
        return f"collective_seq_id is {_text(seq, 0)}, not a sequence number"
    pg = raw.get("process_group")
    pg_name = ("/".join(_text(x, 0) for x in pg[:4]) if isinstance(pg, list | tuple)
               else _text(raw.get("pg_id", ""), 0))
    return FrEntry(_int(seq), pg_name, _text(raw.get("profiling_name", "?")), _text(raw.get("state", "?")),
                   _text(raw.get("input_sizes", "")), _int(raw.get("time_created_ns")))


def summarize(dump: Mapping[str, Any], rank: int) -> FrSummary:
    """One rank's decoded dump, summarised. Raises DumpError (and nothing else) for a dump of the wrong shape;
    entries of the wrong shape are skipped, and said in ``problems``."""
    try:
        return _summarize(dump, rank)
    except DumpError:
        raise
    except Exception as e:  # a hostile dump must cost its rank's summary, never the bundle
        raise DumpError(f"unreadable dump ({type(e).__name__}: {_text(str(e), 0)})") from None


def _summarize(dump: Mapping[str, Any], rank: int) -> FrSummary:
    if not isinstance(dump, Mapping):
        raise DumpError(f"a dump is a dict, this is a {type(dump).__name__}")
    raw_entries = dump.get("entries")
    if raw_entries is None:
        raw_entries = []
    if not isinstance(raw_entries, list | tuple):
        raise DumpError(f"unreadable dump: entries is a {type(raw_entries).__name__}, not a list")
    raw_status = dump.get("pg_status")
    if raw_status is None:
        raw_status = {}
    if not isinstance(raw_status, Mapping):
        raise DumpError(f"unreadable dump: pg_status is a {type(raw_status).__name__}, not a dict")
    entries: list[FrEntry] = []
    refused: dict[str, int] = {}
    for e in raw_entries:
        got = _entry(e) if isinstance(e, Mapping) else f"an entry is a {type(e).__name__}, not a dict"
        if isinstance(got, str):
            refused[got] = refused.get(got, 0) + 1
        else:
            entries.append(got)
    problems = [f"{n} of {len(raw_entries)} entries skipped: {why}" for why, n in refused.items()][:8]
    status: dict[str, dict[str, int]] = {}
    for pg, st in raw_status.items():
        if isinstance(st, Mapping):
            status[_text(pg, 0)] = {_text(k, 0): v for k, v in st.items() if _int(v) is not None}
        elif len(problems) < 16:
            problems.append(f"pg_status of {_text(pg, 0)} is a {type(st).__name__}, not a dict: skipped")
    version = _text(dump.get("version", ""), 0)
    if not entries:
        note = BYPASS_NOTE if not raw_entries else "no readable collective entry in the dump"
        return FrSummary(rank, 0, version, pg_status=status, note=note, problems=tuple(problems))
    coll = [e for e in entries if e.seq is not None] or entries
    last = max(coll, key=lambda e: (e.seq or 0, e.created_ns or 0))
    unfinished = [e for e in coll if e.state != "completed"]
    first = min(unfinished, key=lambda e: (e.seq or 0, e.created_ns or 0)) if unfinished else None
    return FrSummary(rank, len(entries), version, last, first, status, problems=tuple(problems))


def cross_rank_fr(summaries: Sequence[FrSummary]) -> str:
    """One sentence over every rank's recorder: who lags, or where they all wait. Pure."""
    seen = [s for s in summaries if s.last_entered is not None]
    if not summaries:
        return ""
    if not seen:
        if any(s.note == BYPASS_NOTE for s in summaries):
            return BYPASS_NOTE
        return "no rank's recorder held a readable collective"
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
