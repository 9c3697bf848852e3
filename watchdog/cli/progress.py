"""What a verb that takes a while (``check``, ``dump``, ``nodes``) is doing, as lines on stderr, only when stderr is
a terminal: piped or redirected (scripts, journald, ``--json`` into jq) nothing extra is written. Each line is
``watchdog VERB: 3.1s: what``, the seconds since the verb began."""

from __future__ import annotations

import sys
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

    def say(self, text: str) -> None:
        if not self.on:
            return
        try:
            print(f"watchdog {self.verb}: {time.monotonic() - self.began:.1f}s: {text}", file=self.stream,
                  flush=True)
        except (OSError, ValueError):  # the terminal went away: the verb goes on, its result still printed
            self.on = False
