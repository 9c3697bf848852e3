"""Fetch one `/metrics` page and turn it into a Scrape: a reading, or a classified failure.

Every failure gets a short stable ``error_kind``; the judgement maps kinds to states (a server that
refuses connections is down, a page that cannot be read is blind). Nothing here decides health.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from watchdog.scrape.engine_http import LOST, EngineHTTP, HttpFailure
from watchdog.scrape.http1 import PageClient
from watchdog.scrape.page import PageError, read_page
from watchdog.types import NO_ANSWER, HttpLimits, Scrape

log = logging.getLogger(__name__)


class MetricsFetcher:
    """Reads ``BASE/metrics`` through the engine's one session, with its limits on time and size."""

    def __init__(
        self,
        http: EngineHTTP | str,
        limits: HttpLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.http = http if isinstance(http, EngineHTTP) else EngineHTTP(http, limits)
        self.url = self.http.base + "/metrics"
        # the 1 Hz GET on its own keep-alive socket: a tenth of the CPU of requests (bench/profile_tick.py)
        self._page: PageClient | None = None
        if self.http.base.startswith("http://"):
            self._page = PageClient(self.http.base, self.http.limits, self.http.auth_headers)
            self.http.close_with(self._page.close)
        self._clock = clock
        self._wall = wall

    def scrape(self) -> Scrape:
        t, wall = self._clock(), self._wall()
        started = time.monotonic()
        try:
            if self._page is not None:
                reply = self._page.get("/metrics", accept="text/plain")
            else:
                reply = self.http.get("/metrics", accept="text/plain")
        except HttpFailure as f:
            log.debug("scrape of %s failed: %s", self.url, f.message)
            kind = NO_ANSWER if f.kind == LOST else f.kind
            return Scrape(t, wall, None, kind, f.message, f.status, elapsed=time.monotonic() - started)
        elapsed = time.monotonic() - started
        status, body = reply.status, reply.body
        if status >= 500:
            return Scrape(t, wall, None, "http_5xx", f"{self.url} answered HTTP {status}", status, len(body), elapsed)
        if status != 200:
            return Scrape(t, wall, None, "http_status", f"{self.url} answered HTTP {status}, expected 200", status,
                          len(body), elapsed)
        if "html" in reply.content_type.lower():
            return Scrape(t, wall, None, "html", f"{self.url} answered an HTML page ({reply.content_type}), "
                          "not Prometheus text", status, len(body), elapsed)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            return Scrape(t, wall, None, "not_text", f"page is not UTF-8 text ({e.reason} at byte {e.start})",
                          status, len(body), elapsed)
        try:
            page = read_page(text)
        except PageError as e:
            return Scrape(t, wall, None, e.kind, e.message, status, len(body), elapsed)
        return Scrape(t, wall, page, None, "", status, len(body), elapsed)
