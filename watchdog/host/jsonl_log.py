"""A JSON-lines log on this host's disk (the event log, the alert delivery log): appended a record at a time, rolled
over to ``NAME.1`` past its bound (the two generations hold at most twice the bound and one line), a full or broken
disk returned as the error rather than raised."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)


def generations(path: Path) -> tuple[Path, Path]:
    """The rolled-over log and the current one, oldest first."""
    return path.with_name(path.name + ".1"), path


class JsonLinesLog:
    """Appends one JSON object a line; never raises for the disk (the error is returned, counted and logged once
    per streak); past ``max_bytes`` rolls the file over to ``.1``. One writer at a time (the caller's lock)."""

    what = "records"  # what a line holds, as the log lines say it

    def __init__(self, path: Path, max_bytes: int = 0) -> None:
        self.path = path
        self.max_bytes = max_bytes  # 0: never rolled over
        self._f: IO[str] | None = None
        self._size = 0
        self.failures = 0  # writes lost in the current streak of failures
        self.lost = 0  # writes lost since start

    def write(self, record: dict[str, object]) -> OSError | None:
        """Append one JSON line; returns the error when it could not (the first of a streak is logged)."""
        try:
            if self._f is None:
                self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across writes
                self._size = os.fstat(self._f.fileno()).st_size
            line = json.dumps(record) + "\n"
            self._f.write(line)
            self._f.flush()
            self._size += len(line.encode("utf-8"))
        except OSError as e:
            self._drop()
            self.failures += 1
            self.lost += 1
            if self.failures == 1:
                log.error("cannot write %s: %s (%s are lost until it can; the watch goes on)", self.path,
                          e.strerror or e, self.what)
            return e
        if self.failures:
            log.warning("writing %s again after %d lost %s", self.path, self.failures, self.what)
            self.failures = 0
        if self.max_bytes and self._size > self.max_bytes:
            self._roll()
        return None

    def _roll(self) -> None:
        self._drop()
        try:
            os.replace(self.path, generations(self.path)[0])
        except OSError as e:  # the line is written; the file grows on and the next write tries again
            log.warning("cannot roll %s over: %s", self.path, e.strerror or e)

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
