"""The text dump formats: py-spy text (plain, --native, transcribed), faulthandler, tracebacks, Flight Recorder and gdb
numbered frames, kernel stacks, under the prefixes pasted text carries. Pure: text in, ProcessStacks out.

One line-driven state machine; the line shapes of the formats other than py-spy's own are in ``lines``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from watchdog.evidence.stacks import lines
from watchdog.evidence.stacks.frames import Frame, ProcessStack, StackParseError, ThreadStack

_MAX_LINE = 4000  # longer lines are never frames; also bounds regex work on hostile input
_MAX_TITLE_LINES = 64


# ---------------------------------------------------------------------------------------------- text

_PROC = re.compile(r"^Process (?P<pid>\d+|<\w+>):\s?(?P<title>.*)$")
_PYVER = re.compile(r"^Python v?\d+\.\d+")
_TITLE_PYVER = re.compile(r"\s+\(Python \d[\w.+]*\)\s*$")  # a transcribed 'VLLM::Worker_TP0   (Python 3.12.3)'
# "Thread 12 (idle): "MainThread"", "Thread <pid> (active): ..." (pid replaced by a placeholder), "Thread (idle)"
_PYSPY_THREAD = re.compile(
    r'^Thread(?: (?P<id>0x[0-9a-fA-F]+|\d+|<\w+>))? \((?P<state>[a-z+]*)\)(?::? "(?P<name>[^"]*)"?)?\s*$'
)
_FH_THREAD = re.compile(
    r"^(?P<cur>Current thread|Thread|Stack)(?: (?P<id>0x[0-9a-fA-F]+))?(?: \[(?P<name>[^\]]*)\])?"
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
    kind: str  # "pyspy", "fh" (faulthandler), "tb" (traceback, frames kept outermost first), "num", "kernel"
    current: bool = False
    chained: bool = False  # a traceback announced as caused by / raised while handling the previous one
    frames: list[Frame] = field(default_factory=list)
    indent: int | None = None


def _stitch(threads: list[_Thread]) -> list[_Thread]:
    """Join a chained traceback to its cause when the cause starts in the frame where the later one ends."""
    out: list[_Thread] = []
    for t in threads:
        prev = out[-1] if out else None
        if t.kind == "tb" and t.chained and prev is not None and prev.kind == "tb" and prev.frames and t.frames:
            a, b = prev.frames[0], t.frames[-1]
            if (a.function, a.file) == (b.function, b.file):
                out[-1] = _Thread(t.ident, t.name, t.active, t.gil, "tb", frames=t.frames[:-1] + prev.frames)
                continue
        out.append(t)
    return out


@dataclass
class _Proc:
    pid: int | None = None
    title: str = ""
    threads: list[_Thread] = field(default_factory=list)

    def freeze(self) -> ProcessStack | None:
        kept = _stitch([t for t in self.threads if t.frames or t.name])
        if not any(t.frames for t in kept):
            return None
        kinds = {t.kind for t in kept}
        source = next((src for kind, src in (("fh", "faulthandler"), ("tb", "traceback"), ("kernel", "kernel"),
                                              ("num", "numbered")) if kind in kinds), None)
        if source is None:
            source = "py-spy-native" if any(f.native for t in kept for f in t.frames) else "py-spy-text"
        threads = tuple(ThreadStack(t.ident, t.name, tuple(reversed(t.frames)) if t.kind == "tb" else tuple(t.frames),
                                    t.active, t.gil, t.current) for t in kept)
        return ProcessStack(self.pid, self.title.strip(), threads, source)


class _TextParser:
    def __init__(self) -> None:
        self.procs: list[_Proc] = [_Proc()]
        self.thread: _Thread | None = None
        self.title_lines: int | None = None  # not None while reading a (possibly multi-line) process title
        self.chain = False  # a "The above exception was the direct cause ..." line was seen

    @property
    def proc(self) -> _Proc:
        return self.procs[-1]

    def new_proc(self, pid: int | None, title: str) -> None:
        if self.proc.threads or self.proc.pid is not None:
            self.procs.append(_Proc())
        self.proc.pid, self.proc.title, self.thread = pid, title, None

    def new_thread(self, ident: str, name: str, state: str | None, kind: str, current: bool = False) -> _Thread:
        parts = set(state.split("+")) if state else set()
        active = True if "active" in parts else (False if "idle" in parts else None)
        gil = ("gil" in parts) if parts else None
        self.thread = _Thread(ident, name, active, gil, kind, current, chained=kind == "tb" and self.chain)
        self.chain = False
        self.proc.threads.append(self.thread)
        return self.thread

    def feed(self, raw: str) -> None:
        line = raw.rstrip("\r\n")
        if len(line) > _MAX_LINE:
            return
        line = lines.strip_prefixes(line)
        prefix = _PREFIX.match(line)  # a log prefix never starts a real dump line, so strip it whenever present
        if prefix is not None:
            if prefix.group("ray") and self.proc.pid != int(prefix.group("rpid")):
                self.new_proc(int(prefix.group("rpid")), prefix.group("ray"))
            line = lines.strip_prefixes(line[prefix.end() :])
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
        if thread is not None and thread.kind == "pyspy" and thread.indent is not None and indent > thread.indent:
            return True  # a --locals line ("name: value") or its label: never kept
        if m := _PROC.match(line):
            pid = m.group("pid")
            self.new_proc(int(pid) if pid.isdigit() else None, _TITLE_PYVER.sub("", m.group("title")))
            self.title_lines = 0
            return True
        if m := _FH_THREAD.match(line):
            self.new_thread(m.group("id") or "", m.group("name") or "", None, "fh", m.group("cur") == "Current thread")
            return True
        if m := _PYSPY_THREAD.match(line):
            ident = m.group("id") or ""
            self.new_thread("" if ident.startswith("<") else ident, m.group("name") or "", m.group("state"), "pyspy")
            return True
        return self._take_traceback(line, indent) or self._take_other(line)

    def _take_traceback(self, line: str, indent: int) -> bool:
        thread = self.thread if self.thread is not None and self.thread.kind == "tb" else None
        if lines.TRACEBACK.match(line):
            self.new_thread("", "", None, "tb")
            return True
        if lines.CHAINED.match(line):
            self.chain, self.thread = True, None
            return True
        if tb := lines.traceback_frame(line):
            if thread is None:
                thread = self.new_thread("", "", None, "tb")  # a fragment pasted without its header
            thread.frames.append(tb[0])
            thread.indent = tb[1] if thread.indent is None else thread.indent
            return True
        if thread is not None:
            if indent > (thread.indent or 0) or line.strip() in ("...", "…"):
                return True  # the source line under a frame, its ^^^^ markers, a "...<2 lines>..." elision
            self.thread = None  # the exception line ends the traceback
            return True
        return False

    def _take_other(self, line: str) -> bool:
        thread = self.thread
        if m := _FH_FRAME.match(line):
            if thread is None or thread.kind != "fh":
                thread = self.new_thread("", "", None, "fh")
            number = m.group("line")
            thread.frames.append(Frame(m.group("func"), m.group("file"), int(number) if number.isdigit() else None))
            return True
        if numbered := lines.numbered_frame(line):
            n, frame = numbered
            if thread is None or thread.kind != "num" or (n == 0 and thread.frames):
                thread = self.new_thread("", "", None, "num")
            thread.frames.append(frame)
            return True
        if gdb := lines.gdb_thread(line):
            self.new_thread(gdb[0], gdb[1], None, "num")
            return True
        if thread is not None and thread.kind == "num" and line[:1].isspace():
            return True  # gdb's continuation line ("   from /lib/x.so")
        return self._take_kernel(line) or self._take_rest(line)

    def _take_kernel(self, line: str) -> bool:
        if task := lines.kernel_task(line):
            self.new_proc(*task)
            return True
        kernel = lines.kernel_frame(line)
        if lines.is_kernel_line(line) or kernel is not None:
            thread = self.thread if self.thread is not None and self.thread.kind == "kernel" else None
            if thread is None:
                thread = self.new_thread("", "", None, "kernel")
            if isinstance(kernel, Frame):
                thread.frames.append(kernel)
            return True
        return False

    def _take_rest(self, line: str) -> bool:
        if line.strip() in ("...", "…") and self.thread is not None:
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
        thread = self.thread if self.thread is not None and self.thread.kind == "pyspy" else None
        if thread is not None and thread.indent is not None and indent != thread.indent:
            thread = None  # a dump's frames share one indentation; anything else is log text
        if ": " in func:
            return thread is not None
        if thread is None:
            if not (_STRICT_FUNC.match(func) and _STRICT_FILE.match(path)):
                return False
            thread = self.new_thread("", "", None, "pyspy")  # frames before any header (excerpt, condensed paste)
        if thread.indent is None:
            thread.indent = indent
        number = m.group("line")
        thread.frames.append(Frame(func, path, int(number) if number else None, native=_native_file(path)))
        return True


def parse_text(text: str) -> list[ProcessStack]:
    """Every process found in a py-spy text (plain or --native), faulthandler, traceback, Flight Recorder, gdb or
    kernel-stack dump, under the prefixes pasted text carries. Unreadable text gives []."""
    if not isinstance(text, str):
        raise StackParseError(f"expected text, got {type(text).__name__}")
    parser = _TextParser()
    for line in text.splitlines():
        parser.feed(line)
    return [ps for ps in (p.freeze() for p in parser.procs) if ps is not None]
