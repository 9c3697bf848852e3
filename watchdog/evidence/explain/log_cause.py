"""Why an engine went down, from its log: the first fatal error of its last life, and the headline of a `down`
incident built on it. Pure: the log's text in, words out.

A crashed vLLM leaves its cause in its log and nowhere else: EngineCore (or a worker) prints the traceback of what
killed it (``torch.AcceleratorError: CUDA error: an illegal memory access was encountered``), then the API server
prints the consequence (``EngineDeadError: EngineCore encountered an issue``) and shuts down. So the cause is:

- looked for only in the engine's **last life**: after the last line that marks a server starting (a log file
  appended across restarts holds older crashes above it);
- the **first** error there that is not a consequence of another (``EngineDeadError``, a cancelled task, a
  shutdown's own errors come after the cause);
- read through vLLM's prefixes (``(EngineCore pid=728) ERROR 12-03 17:28:43 [core.py:1233]``) and journald's
  (``2026-12-03T17:28:43+0000 host vllm[601]:``), which also name the process that printed it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from watchdog.core.runbooks import Runbook

# a server's life begins: vLLM's API server and engine banners (0.25 to 0.34), a new life of the log
_BOOT = re.compile(r"vLLM API server version|Initializing a V1 LLM engine|Starting vLLM API server|"
                   r"non-default args:")
_JOURNAL = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+[+-]\d{4} \S+ [^\s:]+: ")  # journalctl -o short-iso
_PROC = re.compile(r"^\((?P<who>[^()]*?)(?: pid=(?P<pid>\d+))?\) ")  # vLLM's (EngineCore pid=728)
_LEVEL = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\] ")
_EXCEPTION = re.compile(r"^(?P<exc>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))"
                        r"(?:: (?P<msg>.*))?$")
_FATAL = re.compile(r"^(?:Fatal Python error: (?P<fatal>.+)|(?P<died>.*\bdied unexpectedly\b.*))$")
# errors that follow a cause rather than being one
_CONSEQUENCE = re.compile(r"EngineDeadError|EngineGenerateError|CancelledError|KeyboardInterrupt|SystemExit|"
                          r"BrokenPipeError|ConnectionResetError|GeneratorExit")
_KINDS = (("cuda", re.compile(r"CUDA error|cudaError|CUBLAS_STATUS|cuDNN error|device-side assert")),
          ("out_of_memory", re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)),
          ("nccl", re.compile(r"NCCL|DistBackendError")),
          ("timeout", re.compile(r"timed out|TimeoutError")),
          ("crash", re.compile(r"Segmentation fault|Aborted|Bus error|died unexpectedly")))
MAX_SAID = 200  # characters of the error quoted in a headline


@dataclass(frozen=True, slots=True)
class LogCause:
    """The error that ended the engine's last life, as its log has it."""

    error: str  # what it says: "CUDA error: an illegal memory access was encountered"
    exception: str  # its type as printed ("torch.AcceleratorError"); "" for a line that is not an exception
    process: str  # who printed it ("EngineCore", "Worker_TP1"; "" when the line names nobody)
    pid: int | None
    line: int  # its line in the text read (1 = first)
    kind: str  # cuda | out_of_memory | nccl | timeout | crash | exception
    consequence: bool  # only a consequence was found (EngineDeadError): the cause was not printed, or scrolled out

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _strip(line: str) -> tuple[str, str, int | None]:
    """(the text, who printed it, its pid), without journald's and vLLM's prefixes."""
    line = _JOURNAL.sub("", line.rstrip("\r\n"), count=1)
    who, pid = "", None
    if m := _PROC.match(line):
        who, pid = m["who"].strip(), int(m["pid"]) if m["pid"] else None
        line = line[m.end():]
    return _LEVEL.sub("", line, count=1).strip(), who, pid


def _kind(text: str) -> str:
    return next((name for name, rx in _KINDS if rx.search(text)), "exception")


def cause_of(log: str) -> LogCause | None:
    """The first error of the log's last life that is not a consequence of another; the first consequence when
    nothing else is there; None when the log holds no error."""
    lines = log.splitlines()
    start = max((i for i, raw in enumerate(lines) if _BOOT.search(raw)), default=-1) + 1
    consequence: LogCause | None = None
    for i in range(start, len(lines)):
        text, who, pid = _strip(lines[i])
        if m := _EXCEPTION.match(text):
            exc, msg = m["exc"], (m["msg"] or "").strip()
            error = msg or exc.rsplit(".", 1)[-1]
        elif f := _FATAL.match(text):
            exc, error = "", (f["fatal"] or f["died"]).strip()
        else:
            continue
        found = LogCause(error[:MAX_SAID], exc, who, pid, i + 1, _kind(f"{exc} {error}"), False)
        if not _CONSEQUENCE.search(exc or error):
            return found
        if consequence is None:
            consequence = LogCause(found.error, exc, who, pid, found.line, found.kind, True)
    return consequence


def said(cause: LogCause) -> str:
    """The cause in the words of a headline: "the engine died: CUDA error: ... (torch.AcceleratorError in
    EngineCore)"."""
    typ = cause.exception if cause.exception and cause.exception.rsplit(".", 1)[-1] not in cause.error else ""
    where = " in ".join(x for x in (typ, cause.process) if x)
    if cause.consequence:
        return (f"the engine is dead: {cause.error}{f' ({where})' if where else ''}; its cause is not in the log "
                "read (scrolled out, or printed elsewhere)")
    if not typ and cause.process:
        where = f"in {cause.process}"
    return f"the engine died: {cause.error}{f' ({where})' if where else ''}"


def down_runbook(reason: str, cause: LogCause | None = None) -> Runbook:
    """The page of a down incident: the engine's own error, a rank lost ("... exited on node w1"), or the API
    server that does not answer."""
    if cause is not None and not cause.consequence:
        return Runbook.DOWN_ENGINE_ERROR
    return Runbook.DOWN_RANK_LOST if " on node " in reason else Runbook.DOWN_API


def down_headline(reason: str, cause: LogCause | None, log_read: bool) -> tuple[str, Runbook]:
    """A down incident's headline and runbook: the log's cause first, then what the watchdog saw (``log_read``:
    an engine log was read at all; without one, ``[capture] log_file``, ``journal_unit`` or ``docker_container``)."""
    if cause is None:
        said_log = "the engine log read shows no error" if log_read else "no engine log configured to say why"
        return f"down: {reason}; {said_log}", down_runbook(reason)
    return f"down: {said(cause)}", down_runbook(reason, cause)
