"""What a verb that takes a while (``check``, ``dump``, ``nodes``) is doing, as lines on stderr, only when stderr is
a terminal: piped or redirected (scripts, journald, ``--json`` into jq) nothing extra is written. Each line is
``watchdog VERB: 3.1s: what``, the seconds since the verb began."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    def __init__(self, verb: str, stream: TextIO | None = None) -> None:
        self.verb = verb
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.on = self.stream.isatty()
        except (AttributeError, ValueError):  # a closed or odd stream: no terminal
            self.on = False
        self.began = time.monotonic()
        self._lock = threading.Lock()  # `nodes` says from a thread per node: one whole line at a time

    def say(self, text: str) -> None:
        if not self.on:
            return
        line = f"watchdog {self.verb}: {time.monotonic() - self.began:.1f}s: {text}\n"
        try:  # one write of the whole line under the lock: print() writes the text and its newline apart, and two
            with self._lock:  # threads' lines would interleave into "a: fine b: fine" on one line
                self.stream.write(line)
                self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: the verb goes on, its result still printed
            self.on = False
