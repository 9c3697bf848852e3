"""Fetch one `/metrics` page and turn it into a Scrape: a reading, or a classified failure.

Every failure gets a short stable ``error_kind``; the judgement maps kinds to states (a server that
refuses connections is down, a page that cannot be read is blind). Nothing here decides health.

The page is asked for with only the samples the judgement reads: ``/metrics/?name[]=...``, prometheus_client's own
filter. vLLM 0.32 answers ``/metrics`` from prometheus-fastapi-instrumentator's route, which ignores a query, and
``/metrics/`` from prometheus_client's app, which honours it: 2.3 KB instead of 52 KB, less work for the engine's
API server and for us (bench/bench_page_filter.py). A server that does not filter is found and read whole: the
filtered answer is checked against the whole page when the filter is first used and every ``RECHECK`` seconds,
and any answer of the filtered path that cannot be used is retried whole at once.

A page that gives no answer in time is not yet a server that stopped answering: ``/health`` is asked (a short
wait). If it answers 200, the API server serves and only its page is stuck (``page_hangs``: the judge cannot see,
so blind, and a confirmed freeze stays frozen); if it does not, the kind stays ``no_answer``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import urlencode

from watchdog.core.types import NO_ANSWER, PAGE_HANGS, HttpLimits, PageReading, Scrape
from watchdog.scrape.engine_http import LOST, EngineHTTP, HttpFailure
from watchdog.scrape.page import WANTED_SAMPLES, PageError, read_page

log = logging.getLogger(__name__)

WHOLE = "/metrics"
FILTERED = "/metrics/?" + urlencode([("name[]", n) for n in WANTED_SAMPLES])
RECHECK = 600.0  # seconds between checks of the filtered page against the whole one, and before a filter is retried
# Failures that do not depend on the path asked (the server, or the way to it): never retried whole in the same pass.
_TRANSPORT = frozenset({NO_ANSWER, "refused", "unreachable", "too_big", "trickle", "truncated"})
_SMALLER = 0.8  # a filtered page at least this share of the whole one is not filtered (or came through a redirect)
HEALTH_WAIT = 2.0  # seconds, at most, for /health's answer once the page gave none


def _series(page: PageReading) -> set[tuple[str, str]]:
    """Which (engine, reading) pairs a page has: the filtered page must have all of the whole page's."""
    out: set[tuple[str, str]] = set()
    for name, e in page.engines.items():
        out.update((name, f) for f, v in (("running", e.running), ("waiting", e.waiting), ("kv_usage", e.kv_usage))
                   if v is not None)
        out.update((name, f) for f in e.counters)
    return out


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
        self.url = self.http.base + WHOLE
        self._clock = clock
        self._wall = wall
        self._filter_from = float("-inf")  # when a filter found wanting may be tried again
        self._checked_at: float | None = None  # when the filtered page last matched the whole one

    @property
    def filtering(self) -> bool:
        """Whether the next scrape asks for only the read samples."""
        return self._clock() >= self._filter_from

    def scrape(self) -> Scrape:
        got = self._scrape()
        return self._health_answers(got) if got.error_kind == NO_ANSWER else got

    def _health_answers(self, got: Scrape) -> Scrape:
        """The page gave no answer: does the API server answer ``/health``? One short GET, its answer's body capped."""
        wait = min(HEALTH_WAIT, self.http.limits.read_timeout)
        try:
            status = self.http.get("/health", read_timeout=wait, max_bytes=4096).status
        except HttpFailure as f:
            log.debug("/health after the page's silence: %s", f.message)
            return got
        if status != 200:
            return got
        return replace(got, error_kind=PAGE_HANGS, error=f"{got.error}; /health answered 200, so the API server "
                       "serves but its page is stuck")

    def _scrape(self) -> Scrape:
        t, wall = self._clock(), self._wall()
        if not self.filtering:
            return self._fetch(WHOLE, t, wall)
        got = self._fetch(FILTERED, t, wall)
        if got.page is not None and got.page.engines:
            if self._checked_at is not None and t - self._checked_at < RECHECK:
                return got
            whole = self._fetch(WHOLE, t, wall)
            if whole.page is None:
                return got  # the whole page failed where the filtered one did not: the check waits for next time
            if not _series(whole.page) <= _series(got.page):
                return self._stop_filter(t, whole, "the filtered page lacks series the whole page has")
            if got.size >= _SMALLER * whole.size:
                return self._stop_filter(t, whole, f"the filtered page is not smaller ({got.size} of {whole.size} "
                                         "bytes): the server ignores the filter")
            self._checked_at = t
            return got
        if got.error_kind in _TRANSPORT:
            return got  # nothing to do with the path: a second GET would only double the wait
        whole = self._fetch(WHOLE, t, wall)
        if whole.page is None:
            return whole  # neither answer can be read: the whole page's failure is the one to report
        why = f"{got.error_kind}: {got.error}" if got.error_kind else "it has none of the read series"
        return self._stop_filter(t, whole, f"the filtered page cannot be used ({why})")

    def _stop_filter(self, t: float, whole: Scrape, why: str) -> Scrape:
        log.info("reading %s whole for %.0f s: %s", self.url, RECHECK, why)
        self._filter_from, self._checked_at = t + RECHECK, None
        return whole

    def _fetch(self, path: str, t: float, wall: float) -> Scrape:
        started = time.monotonic()
        try:
            reply = self.http.get_page(path, accept="text/plain")
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
