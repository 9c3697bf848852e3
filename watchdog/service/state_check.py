"""Whether the state directory can be used, for the watchdog's own probes: asked when a probe comes (never on a pass),
and looked at again at most every few seconds, whoever asks.

Unusable: the directory is gone or not a directory, its filesystem is read-only, out of space or of inodes, or the
last event could not be written (the event log's streak of failures). One ``statvfs`` and one ``stat`` a look.

A failed event write counts only until the check's own test write succeeds: while the event log has failures no test
write has answered for, each look also creates, writes and unlinks a small file in the directory; once that works the
disk has room again and the streak is forgiven (a calm engine writes no event that could end it). A later failure
counts again. So a brief disk-full clears within one look (``LOOK_EVERY``) of the disk having room.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

LOOK_EVERY = 5.0  # seconds between looks at the filesystem (a probe every second costs one look in five)
MIN_FREE_BYTES = 1024 * 1024  # less than this left: an event line fits, an incident bundle does not


class StateDirCheck:
    """``check()`` -> "" while the directory can be used, else why not. ``event_failures`` says how many events in a
    row could not be written (the event log's own count)."""

    def __init__(self, path: Path, event_failures: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._event_failures = event_failures
        self._clock = clock
        self._lock = threading.Lock()
        self._looked = float("-inf")
        self._seen = ""
        self._forgiven = 0  # the event log's failure count when a test write last succeeded

    def __call__(self) -> str:
        failures = self._event_failures()
        with self._lock:
            if failures < self._forgiven or not failures:
                self._forgiven = 0  # the streak ended (a write succeeded): nothing left to forgive
            now = self._clock()
            if now - self._looked >= LOOK_EVERY:
                self._looked, self._seen = now, self._look()
                if not self._seen and failures > self._forgiven:
                    self._seen = self._test_write()
                    if not self._seen:
                        self._forgiven = failures
            if self._seen:
                return self._seen
            if failures > self._forgiven:
                return (f"{failures} event(s) in a row could not be written to {self.path}/events.jsonl "
                        f"(cleared by the next event written or by a test write, tried every {LOOK_EVERY:g}s)")
            return ""

    def _test_write(self) -> str:
        """Create, write and unlink a small file in the directory: "" when it worked, else why not."""
        probe = self.path / f".state-check-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"x" * 512)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(probe)
            return f"a test write in {self.path} failed: {e.strerror or e}"
        return ""

    def _look(self) -> str:
        try:
            st = os.stat(self.path)
            if not stat.S_ISDIR(st.st_mode):
                return f"{self.path} is not a directory"
            vfs = os.statvfs(self.path)
        except OSError as e:
            return f"{self.path}: {e.strerror or e}"
        if vfs.f_flag & os.ST_RDONLY:
            return f"{self.path} is on a read-only filesystem"
        free = (vfs.f_bfree if os.geteuid() == 0 else vfs.f_bavail) * vfs.f_frsize
        if free < MIN_FREE_BYTES:
            return f"{self.path}: no space left ({free} bytes free)"
        if vfs.f_files and not (vfs.f_ffree if os.geteuid() == 0 else vfs.f_favail):
            return f"{self.path}: no inodes left"
        if os.geteuid() != 0 and not os.access(self.path, os.W_OK | os.X_OK):
            return f"{self.path} is not writable by this user"
        return ""
