"""systemd integration at the edge: sd_notify and journald logging, both no-ops outside systemd.

``Notifier`` sends through libsystemd's ``sd_notify`` (``systemd.daemon.notify``, from systemd-python, the package
that also gives the journal handler), which writes to the process's ``$NOTIFY_SOCKET``: a path or, with a leading
``@``, an abstract socket. Where systemd-python is not installed (a container, a host without libsystemd) the same
datagram goes out through a plain ``AF_UNIX`` socket, and logging goes to stderr: the watchdog runs anywhere.
With ``WatchdogSec=`` systemd sets ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``); the Notifier
then pings ``WATCHDOG=1`` at half that interval, but only when the loop asks (``ping_if_due``): there is no thread,
so a wedged loop stops pinging and systemd restarts the service.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def _datagram(state: str) -> bool:
    """sd_notify(3) without libsystemd: one datagram to ``$NOTIFY_SOCKET``; False when it is unset or unusable."""
    address = notify_address(os.environ.get("NOTIFY_SOCKET", ""))
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(1.0)
        s.sendto(state.encode(), address)
    return True


def _notify_function() -> Callable[[str], bool]:
    try:
        from systemd import daemon  # noqa: PLC0415
    except ImportError:
        return _datagram
    return lambda state: bool(daemon.notify(state))


def notify_address(value: str) -> str | None:
    """The socket address for ``NOTIFY_SOCKET``: an absolute path, or ``@name`` (abstract); None otherwise."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """``WatchdogSec=`` in seconds, as ``sd_watchdog_enabled`` reads it; None when off or meant for another pid."""
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    if not usec.isdigit() or int(usec) == 0:
        log.warning("WATCHDOG_USEC=%r is not a positive integer: not pinging systemd's watchdog", usec)
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner and owner != str(pid):  # inherited from a parent that systemd watches, not us
        return None
    return int(usec) / 1e6


class Notifier:
    """sd_notify when ``NOTIFY_SOCKET`` is set; every method is a no-op otherwise. Used by the loop's thread only.

    ``environ`` (default: the process's) says whether to notify and how often to ping; the datagrams go where
    libsystemd reads them to go, the process's own ``$NOTIFY_SOCKET`` (a test that passes an ``environ`` sets that
    too)."""

    def __init__(self, environ: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic,
                 pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = notify_address(raw)
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET=%r is neither a path nor @abstract: not notifying systemd", raw)
        self.enabled = self.address is not None
        self.watchdog_interval = watchdog_interval(env, os.getpid() if pid is None else pid)
        # sd_watchdog_enabled(3): "send ... at least every half the time"
        self.ping_every = self.watchdog_interval / 2 if self.watchdog_interval and self.enabled else None
        self._clock = clock
        self._last_ping: float | None = None
        self._status: str | None = None
        self._failing = False
        self._notify = _notify_function() if self.enabled else _datagram
        self.sent = 0  # datagrams sent, for tests and benchmarks

    def send(self, *fields: str) -> bool:
        """Best effort: a notify that fails is logged (once until one succeeds) and never stops the watching."""
        if self.address is None or not fields:
            return False
        try:
            sent = self._notify("\n".join(fields))  # False: no $NOTIFY_SOCKET in the process's environment
        except OSError as e:
            sent = False
            if not self._failing:
                log.warning("sd_notify to %s failed: %s", self.address.replace("\0", "@"), e)
            self._failing = True
        if sent:
            self._failing = False
            self.sent += 1
        return sent

    def ping_due_in(self) -> float | None:
        """Seconds until a ``WATCHDOG=1`` is due (0 when overdue); None when systemd's watchdog is off."""
        if self.ping_every is None:
            return None
        if self._last_ping is None:
            return 0.0
        return max(0.0, self._last_ping + self.ping_every - self._clock())

    def ping_if_due(self) -> bool:
        """Ping if half the watchdog interval has passed since the last ping. Call it from the loop only."""
        due = self.ping_due_in()
        return due is not None and due <= 0 and self._send_with_ping([])

    def ready(self, status: str) -> None:
        self._status = status
        self._send_with_ping(["READY=1", f"STATUS={status}"], always=True)

    def status(self, status: str) -> None:
        """After a pass: the status line when it changed, and the watchdog ping when it is due, in one datagram."""
        changed = status != self._status
        if self._send_with_ping([f"STATUS={status}"] if changed else []) and changed:
            self._status = status

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    def close(self) -> None:
        """Nothing to release: libsystemd opens a socket for each notification."""

    def _send_with_ping(self, fields: list[str], always: bool = False) -> bool:
        due = self.ping_due_in()
        ping = due is not None and (always or due <= 0)
        if ping:
            fields = [*fields, "WATCHDOG=1"]
            self._last_ping = self._clock()  # sent or not: a failed ping is tried again when the next is due
        return self.send(*fields)


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
