"""A common model for process stacks, and parsers for the dump formats seen in the field.

Pure: text or decoded JSON in, frozen dataclasses out; no I/O. Frames are always innermost first.

Formats read:

- ``py-spy dump --json`` (a list of thread objects; ``locals`` are never kept: they may hold prompts or secrets);
- ``py-spy dump`` text, with or without ``--native`` (``Process N: title`` / ``Thread N (idle): "name"`` /
  ``    func (file:line)``), several processes per file, multi-line titles, transcribed variants;
- Python ``faulthandler`` (``Thread 0x... (most recent call first):`` / ``  File "f.py", line N in func``), with
  the ``Current thread`` (the one that crashed) marked;
- Python tracebacks, chained ones joined to their cause, and fragments without a header (``lines``);
- PyTorch Flight Recorder / NCCL watchdog stacks and gdb backtraces (``#0 f from file:line``, ``#0 0x.. in f ()``);
- kernel stacks (``/proc/PID/stack``, a hung-task ``Call Trace:``);
- any of the above under log noise, markdown quotes or a per-line log prefix (``sglang-1  | ``,
  ``(RayWorkerWrapper pid=1, ...) ``, ``ERROR 06-05 16:27:39 [core.py:502] ``, ``[rank0]: ``).

Anything else (prose) yields no process rather than an exception.
"""

from __future__ import annotations

import json

from watchdog.evidence.stacks.frames import SOURCES, Frame, ProcessStack, StackParseError, ThreadStack
from watchdog.evidence.stacks.text import parse_text

__all__ = ["SOURCES", "Frame", "ProcessStack", "StackParseError", "ThreadStack", "parse_any", "parse_pyspy_json",
           "parse_text"]

# ---------------------------------------------------------------------------------------------- JSON


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _json_frame(raw: object) -> Frame:
    if not isinstance(raw, dict):
        raise StackParseError(f"frame is {type(raw).__name__}, not an object")
    name = raw.get("name")
    path = raw.get("filename") or raw.get("short_filename") or ""
    line = raw.get("line")
    if not isinstance(name, str) or not isinstance(path, str):
        raise StackParseError("frame without a string 'name' and 'filename'")
    number = line if (line := _int(line)) and line > 0 else None
    # py-spy sets 'module' (the shared object) only on native frames; Python frames carry null.
    return Frame(_printable(name), _printable(path), number, native=isinstance(raw.get("module"), str))


def _printable(text: str, limit: int = 1000) -> str:
    """A name from the engine's own code (which its user writes): one line, no terminal escapes, capped."""
    if text.isprintable() and len(text) <= limit:
        return text
    return "".join(c if c.isprintable() else "\ufffd" for c in text[:limit])


def _json_thread(raw: object) -> ThreadStack:
    if not isinstance(raw, dict):
        raise StackParseError(f"thread is {type(raw).__name__}, not an object")
    frames = raw.get("frames")
    if not isinstance(frames, list):
        raise StackParseError("thread without a 'frames' list")
    os_tid, tid = raw.get("os_thread_id"), raw.get("thread_id")
    if isinstance(os_tid, int):
        ident = str(os_tid)  # the number py-spy's text format prints
    elif isinstance(tid, int):
        ident = hex(tid)
    else:
        ident = ""
    name = raw.get("thread_name")
    active, gil = raw.get("active"), raw.get("owns_gil")
    return ThreadStack(
        thread_id=ident,
        name=name if isinstance(name, str) else "",
        frames=tuple(_json_frame(f) for f in frames),
        active=active if isinstance(active, bool) else None,
        gil=gil if isinstance(gil, bool) else None,
    )


def parse_pyspy_json(data: object, pid: int | None = None, title: str = "") -> ProcessStack:
    """One process from ``py-spy dump --json`` output (already decoded). Raises StackParseError on a wrong shape."""
    if not isinstance(data, list):
        raise StackParseError(f"py-spy JSON is a list of threads, got {type(data).__name__}")
    threads = tuple(_json_thread(t) for t in data)
    if pid is None:
        pids = {_int(t.get("pid")) if isinstance(t, dict) else None for t in data}
        pid = pids.pop() if len(pids) == 1 else None
    return ProcessStack(pid=pid, title=title, threads=threads, source="py-spy-json")


def parse_any(data: str | bytes) -> list[ProcessStack]:
    """JSON (py-spy --json, threads grouped per pid) or any text format parse_text reads."""
    if isinstance(data, bytes | bytearray):
        data = bytes(data).decode("utf-8", errors="replace")
    if not isinstance(data, str):
        raise StackParseError(f"expected text or bytes, got {type(data).__name__}")
    body = data.lstrip("\ufeff \t\r\n")
    if body[:1] in ("[", "{"):
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError):
            decoded = None  # e.g. a log line starting with "[2025-..."
        if decoded is not None:
            if not isinstance(decoded, list):
                raise StackParseError("JSON input is not a py-spy thread list")
            groups: dict[int | None, list[object]] = {}
            for thread in decoded:
                groups.setdefault(_int(thread.get("pid")) if isinstance(thread, dict) else None, []).append(thread)
            return [parse_pyspy_json(threads) for threads in groups.values()]
    return parse_text(data)
