"""The agent's audit log: JSON lines, one record per line, every value escaped by the JSON encoder (an argument
holding a newline cannot write a line of its own, and an argv is a list, so ``["a.sh --fast"]`` never reads like
``["a.sh", "--fast"]``).

Every record has ``time`` (UTC, ISO 8601), ``pid`` (the agent's: one session), ``client`` (``SSH_CLIENT``'s
address), ``level`` and ``event``; the agent's own records add what they are about (``verb``, ``reason``,
``argv``...). Records of other modules (a command that survived SIGKILL) come as ``event: "log"`` with their
``message``. The same lines go to stderr, which sshd hands to the head.

The file is opened with ``O_APPEND | O_NOFOLLOW`` (a link planted where it should be is refused, never written
through) and created 0600; each record is one ``write``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

AUDIT = "audit"  # the `extra` key of a log record holding the record's fields


class JsonLines(logging.Formatter):
    def __init__(self, context: dict[str, Any]) -> None:
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, AUDIT, None)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "pid": record.process, **self.context, "level": record.levelname.lower()}
        if isinstance(fields, dict):
            out.update({"event": record.getMessage(), **fields})
        else:
            out.update({"event": "log", "logger": record.name, "message": record.getMessage()})
        if record.exc_info and record.exc_info[0] is not None:
            out["exception"] = self.formatException(record.exc_info)[-2000:]
        return json.dumps(out, default=str, ensure_ascii=True)


class FdHandler(logging.Handler):
    """One ``os.write`` per record on an fd (O_APPEND: records of concurrent sessions never interleave)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            os.write(self.fd, (self.format(record) + "\n").encode())
        except OSError:  # a full disk, the head gone from stderr: the session goes on
            pass
        except Exception:  # a record that cannot be formatted must not end the session
            self.handleError(record)


def open_audit(path: str) -> int:
    """The audit log's fd for appending; OSError when it cannot be (a link, not a regular file...)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return fd


def setup(path: str, context: dict[str, Any]) -> str:
    """Every record of this process to the audit log (``path``; "": none) and stderr, as JSON lines; "" or why the
    file cannot be used."""
    handlers: list[logging.Handler] = []
    problem = ""
    try:
        if path:
            handlers.append(FdHandler(open_audit(path)))
    except OSError as e:
        problem = f"audit log {path}: {e.strerror or e}"
    with contextlib.suppress(ValueError, OSError):
        handlers.append(FdHandler(sys.stderr.fileno()))  # sshd hands stderr to the head too
    fmt = JsonLines(context)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(logging.INFO)
    return problem


def record(logger: logging.Logger, event: str, level: int = logging.INFO, /, **fields: Any) -> None:
    """One audit record: ``event`` and its fields."""
    logger.log(level, event, extra={AUDIT: fields})
