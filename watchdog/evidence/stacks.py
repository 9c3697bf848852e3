"""A common model for process stacks, and parsers for the dump formats seen in the field.

Pure: text or decoded JSON in, frozen dataclasses out; no I/O. Frames are always innermost first.

Formats read:

- ``py-spy dump --json`` (a list of thread objects; ``locals`` are never kept: they may hold prompts or secrets);
- ``py-spy dump`` text, with or without ``--native`` (``Process N: title`` / ``Thread N (idle): "name"`` /
  ``    func (file:line)``), several processes per file, multi-line titles, transcribed variants;
- Python ``faulthandler`` (``Thread 0x... (most recent call first):`` / ``  File "f.py", line N in func``);
- any of the above under log noise or a per-line log prefix (``sglang-1  | ``, ``(RayWorkerWrapper pid=1, ...) ``).

Anything else (gdb backtraces, prose) yields no process rather than an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

SOURCES = ("py-spy-json", "py-spy-text", "py-spy-native", "faulthandler")
_MAX_LINE = 4000  # longer lines are never frames; also bounds regex work on hostile input
_MAX_TITLE_LINES = 64


class StackParseError(ValueError):
    """The input is structured (JSON) but is not a stack dump we can read."""


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str
    line: int | None
    native: bool = False


@dataclass(frozen=True, slots=True)
class ThreadStack:
    thread_id: str
    name: str
    frames: tuple[Frame, ...]  # innermost first
    active: bool | None
    gil: bool | None


@dataclass(frozen=True, slots=True)
class ProcessStack:
    pid: int | None
    title: str
    threads: tuple[ThreadStack, ...]
    source: str  # one of SOURCES


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
    return Frame(name, path, number, native=isinstance(raw.get("module"), str))


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


# ---------------------------------------------------------------------------------------------- text

_PROC = re.compile(r"^Process (?P<pid>\d+):\s?(?P<title>.*)$")
_PYVER = re.compile(r"^Python v?\d+\.\d+")
_TITLE_PYVER = re.compile(r"\s+\(Python \d[\w.+]*\)\s*$")  # a transcribed 'VLLM::Worker_TP0   (Python 3.12.3)'
_PYSPY_THREAD = re.compile(
    r'^Thread(?: (?P<id>0x[0-9a-fA-F]+|\d+))? \((?P<state>[a-z+]*)\)(?::? "(?P<name>[^"]*)"?)?\s*$'
)
_FH_THREAD = re.compile(
    r"^(?:Current thread|Thread|Stack)(?: (?P<id>0x[0-9a-fA-F]+))?(?: \[(?P<name>[^\]]*)\])?"
    r" \(most recent call first\):?\s*$"
)
_FH_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+|\?+) in (?P<func>\S.*?)\s*$')
# Inside a thread: "    func (file:line)" with an optional trailing hand annotation ("← stuck here", "# ...").
_FRAME = re.compile(
    r"^(?P<ind>\s*)(?P<func>\S.*?)\s+\((?P<file>[^()\s][^()]*?)(?::(?P<line>\d+))?\)(?:\s+(?:←|<-|#).*)?\s*$"
)
# Outside any thread header only identifier-like functions and path-like files count, so prose is not read as frames.
_STRICT_FUNC = re.compile(r"^(?:0x[0-9a-fA-F]+|[A-Za-z_<][\w.<>:~]*)$")
_STRICT_FILE = re.compile(r"^[\w./<>+-]*[.<][\w./<>+-]*$")
_PREFIX = re.compile(r"^(?:\((?P<ray>[A-Za-z_]\w*) pid=(?P<rpid>\d+)[^)]*\) ?|[\w.-]+\s+\| ?)")
_FATAL = re.compile(r"^Fatal Python error")


def _native_file(path: str) -> bool:
    return not (path.endswith((".py", ".pyw")) or path.startswith("<"))


@dataclass
class _Thread:
    ident: str
    name: str
    active: bool | None
    gil: bool | None
    fh: bool
    frames: list[Frame] = field(default_factory=list)
    indent: int | None = None


@dataclass
class _Proc:
    pid: int | None = None
    title: str = ""
    threads: list[_Thread] = field(default_factory=list)

    def freeze(self) -> ProcessStack | None:
        kept = [t for t in self.threads if t.frames or t.name]
        if not any(t.frames for t in kept):
            return None
        if any(t.fh for t in kept):
            source = "faulthandler"
        elif any(f.native for t in kept for f in t.frames):
            source = "py-spy-native"
        else:
            source = "py-spy-text"
        threads = tuple(ThreadStack(t.ident, t.name, tuple(t.frames), t.active, t.gil) for t in kept)
        return ProcessStack(self.pid, self.title.strip(), threads, source)


class _TextParser:
    def __init__(self) -> None:
        self.procs: list[_Proc] = [_Proc()]
        self.thread: _Thread | None = None
        self.title_lines: int | None = None  # not None while reading a (possibly multi-line) process title

    @property
    def proc(self) -> _Proc:
        return self.procs[-1]

    def new_proc(self, pid: int | None, title: str) -> None:
        if self.proc.threads or self.proc.pid is not None:
            self.procs.append(_Proc())
        self.proc.pid, self.proc.title, self.thread = pid, title, None

    def new_thread(self, ident: str, name: str, state: str | None, fh: bool) -> _Thread:
        parts = set(state.split("+")) if state else set()
        active = True if "active" in parts else (False if "idle" in parts else None)
        gil = ("gil" in parts) if parts else None
        self.thread = _Thread(ident, name, active, gil, fh)
        self.proc.threads.append(self.thread)
        return self.thread

    def feed(self, raw: str) -> None:
        line = raw.rstrip("\r\n")
        if len(line) > _MAX_LINE:
            return
        prefix = _PREFIX.match(line)  # a log prefix never starts a real dump line, so strip it whenever present
        if prefix is not None:
            if prefix.group("ray") and self.proc.pid != int(prefix.group("rpid")):
                self.new_proc(int(prefix.group("rpid")), prefix.group("ray"))
            line = line[prefix.end() :]
        if not self._take(line):
            self.thread = None  # unrelated text ends the current thread

    def _take(self, line: str) -> bool:
        if not line.strip():
            return True
        if self.title_lines is not None:
            if _PYVER.match(line):
                self.title_lines = None
                return True
            if self.title_lines < _MAX_TITLE_LINES and not (
                _PROC.match(line) or _PYSPY_THREAD.match(line) or _FH_THREAD.match(line)
            ):
                self.title_lines += 1
                self.proc.title += "\n" + line
                return True
            self.title_lines = None
        thread = self.thread
        indent = len(line) - len(line.lstrip())
        if thread is not None and not thread.fh and thread.indent is not None and indent > thread.indent:
            return True  # a --locals line ("name: value") or its label: never kept
        if m := _PROC.match(line):
            self.new_proc(int(m.group("pid")), _TITLE_PYVER.sub("", m.group("title")))
            self.title_lines = 0
            return True
        if m := _FH_THREAD.match(line):
            self.new_thread(m.group("id") or "", m.group("name") or "", None, fh=True)
            return True
        if m := _PYSPY_THREAD.match(line):
            self.new_thread(m.group("id") or "", m.group("name") or "", m.group("state"), fh=False)
            return True
        if m := _FH_FRAME.match(line):
            if thread is None or not thread.fh:
                thread = self.new_thread("", "", None, fh=True)
            number = m.group("line")
            thread.frames.append(Frame(m.group("func"), m.group("file"), int(number) if number.isdigit() else None))
            return True
        if line.strip() in ("...", "…") and thread is not None:
            return True  # frames elided by whoever pasted the dump; the thread goes on
        if _FATAL.match(line):
            if self.proc.threads:
                self.new_proc(None, "")
            return True
        return self._take_pyspy_frame(line)

    def _take_pyspy_frame(self, line: str) -> bool:
        m = _FRAME.match(line)
        if m is None:
            return False
        func, path, indent = m.group("func"), m.group("file").strip(), len(m.group("ind"))
        thread = self.thread if self.thread is not None and not self.thread.fh else None
        if thread is not None and thread.indent is not None and indent != thread.indent:
            thread = None  # a dump's frames share one indentation; anything else is log text
        if ": " in func:
            return thread is not None
        if thread is None:
            if not (_STRICT_FUNC.match(func) and _STRICT_FILE.match(path)):
                return False
            thread = self.new_thread("", "", None, fh=False)  # frames before any header (excerpt, condensed paste)
        if thread.indent is None:
            thread.indent = indent
        number = m.group("line")
        thread.frames.append(Frame(func, path, int(number) if number else None, native=_native_file(path)))
        return True


def parse_text(text: str) -> list[ProcessStack]:
    """Every process found in a py-spy text (plain or --native) or faulthandler dump. Unreadable text gives []."""
    if not isinstance(text, str):
        raise StackParseError(f"expected text, got {type(text).__name__}")
    parser = _TextParser()
    for line in text.splitlines():
        parser.feed(line)
    return [ps for ps in (p.freeze() for p in parser.procs) if ps is not None]


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
