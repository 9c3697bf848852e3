"""The dead-man switch: a GET to a URL after a pass that really observed the engine, at most once an interval.

A watchdog that cannot see (blind: the page unreadable), or that is itself stuck, stops pinging, and the receiver
(healthchecks-style) raises the alarm. The ping runs in a background thread and never delays a pass; a ping still
in flight makes the next one wait for it rather than pile up. Every ping goes over one session, kept for the
heartbeat's life (its connection kept alive between pings the receiver does not close) and closed with it.
"""

from __future__ import annotations

import logging
import threading

import requests

from watchdog.config.load import Secret

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 3.0


class Heartbeat:
    def __init__(self, url: Secret, interval: float, timeout: float = 10.0) -> None:
        self._url, self.interval, self.timeout = url, interval, timeout
        self._last: float | None = None
        self._thread: threading.Thread | None = None
        self._session = requests.Session()  # used by one ping at a time: a ping waits for the one before it
        self.sent = self.failed = 0

    def beat(self, now: float, observed: bool) -> bool:
        """Ping if ``observed`` and the interval has passed; True when a ping was started."""
        if not observed or not self._url:
            return False
        if self._last is not None and now - self._last < self.interval:
            return False
        if self._thread is not None and self._thread.is_alive():
            return False
        self._last = now
        self._thread = threading.Thread(target=self._ping, name="heartbeat", daemon=True)
        self._thread.start()
        return True

    def wait(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Close the session, once a ping in flight has ended (or ``timeout`` has passed)."""
        self.wait(timeout)
        self._session.close()

    def _ping(self) -> None:
        try:
            with self._session.get(self._url.reveal(), timeout=(CONNECT_TIMEOUT, self.timeout),
                                   allow_redirects=False) as r:
                if 200 <= r.status_code < 300:
                    self.sent += 1
                    return
                why = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            why = type(e).__name__  # never str(e): it holds the URL, which may hold a token
        self.failed += 1
        log.warning("heartbeat ping failed: %s", why)
