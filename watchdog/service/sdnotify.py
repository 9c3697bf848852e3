"""systemd integration at the edge: sd_notify and journald logging, both no-ops outside systemd."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)


class Notifier:
    """Speaks sd_notify through systemd-python when ``NOTIFY_SOCKET`` is set."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._notify = None
        if self.enabled:
            try:
                from systemd import daemon  # noqa: PLC0415 - only needed under systemd
            except ImportError:
                log.warning("NOTIFY_SOCKET is set but systemd-python is not installed: not notifying systemd")
                self.enabled = False
            else:
                self._notify = daemon.notify
        usec = os.environ.get("WATCHDOG_USEC", "")
        self.watchdog_interval = int(usec) / 1e6 if usec.isdigit() else None

    def send(self, *fields: str) -> None:
        """Best effort: a notify that fails must not stop the watching. A signal may interrupt the send."""
        if self._notify is None:
            return
        for _attempt in range(3):
            try:
                self._notify("\n".join(fields))
                return
            except InterruptedError:
                continue
            except OSError as e:
                log.warning("sd_notify failed: %s", e)
                return

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}", "WATCHDOG=1")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")


def setup_logging(level: str = "INFO") -> None:
    """Log to journald with structured fields under systemd, else to stderr."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    handler: logging.Handler | None = None
    if os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"):
        try:
            from systemd.journal import JournalHandler  # noqa: PLC0415
        except ImportError:
            handler = None
        else:
            handler = JournalHandler(SYSLOG_IDENTIFIER="engine-watchdog")
            handler.setFormatter(logging.Formatter("%(message)s"))
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers[:] = [handler]
    # urllib3 logs each request line at DEBUG, with a webhook's path: Slack's holds its token
    logging.getLogger("urllib3").setLevel(max(logging.INFO, root.level))
