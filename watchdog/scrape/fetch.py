"""Fetch one `/metrics` page and turn it into a Scrape: a reading, or a classified failure.

Every failure gets a short stable ``error_kind``; the judgement maps kinds to states (a server that
refuses connections is down, a page that cannot be read is blind). Nothing here decides health.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import requests
import urllib3

from watchdog.scrape.page import PageError, read_page
from watchdog.types import NO_ANSWER, Scrape, base_url

log = logging.getLogger(__name__)

# Error kinds, grouped by what they say about the server.

@dataclass(frozen=True, slots=True)
class ScrapeLimits:
    connect_timeout: float = 2.0
    read_timeout: float = 5.0
    deadline: float = 10.0  # whole request, including a server that trickles bytes
    max_bytes: int = 16 * 1024 * 1024
    max_redirects: int = 3


class MetricsFetcher:
    """Reads ``BASE/metrics`` with hard limits on time and size."""

    def __init__(
        self,
        url: str,
        limits: ScrapeLimits | None = None,
        session: requests.Session | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.url = base_url(url) + "/metrics"
        self.limits = limits or ScrapeLimits()
        self.session = session or requests.Session()
        self.session.max_redirects = self.limits.max_redirects
        # Talk to the engine directly: no proxy or netrc from the environment (and no env scan per request).
        self.session.trust_env = False
        self._clock = clock
        self._wall = wall

    def scrape(self) -> Scrape:
        t, wall = self._clock(), self._wall()
        started = time.monotonic()
        try:
            status, body = self._get(started)
        except _Failure as f:
            log.debug("scrape of %s failed: %s", self.url, f.message)
            return Scrape(t, wall, None, f.kind, f.message, f.status, elapsed=time.monotonic() - started)
        elapsed = time.monotonic() - started
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

    def _get(self, started: float) -> tuple[int, bytes]:
        lim = self.limits
        try:
            resp = self.session.get(
                self.url,
                timeout=(lim.connect_timeout, lim.read_timeout),
                stream=True,
                headers={"Accept-Encoding": "identity", "Accept": "text/plain"},
            )
        except requests.exceptions.ConnectTimeout:
            raise _Failure("unreachable", f"no TCP connection to {self.url} within {lim.connect_timeout:g}s") from None
        except requests.exceptions.ReadTimeout:
            raise _Failure(NO_ANSWER, f"{self.url} accepted the connection but sent no response within "
                           f"{lim.read_timeout:g}s") from None
        except requests.exceptions.TooManyRedirects:
            raise _Failure("redirects", f"{self.url} redirects more than {lim.max_redirects} times") from None
        except requests.exceptions.ConnectionError as e:
            text = str(e)
            if "Connection refused" in text or "ECONNREFUSED" in text:
                raise _Failure("refused", f"nothing listening at {self.url} (connection refused)") from None
            raise _Failure("unreachable", f"cannot reach {self.url}: {_short(text)}") from None
        except requests.exceptions.RequestException as e:
            raise _Failure("unreachable", f"request to {self.url} failed: {_short(str(e))}") from None
        with resp:
            if resp.status_code >= 500:
                raise _Failure("http_5xx", f"{self.url} answered HTTP {resp.status_code}", resp.status_code)
            if resp.status_code != 200:
                raise _Failure("http_status", f"{self.url} answered HTTP {resp.status_code}, expected 200",
                               resp.status_code)
            ctype = resp.headers.get("Content-Type", "")
            if "html" in ctype.lower():
                raise _Failure("html", f"{self.url} answered an HTML page ({ctype}), not Prometheus text",
                               resp.status_code)
            return resp.status_code, self._read_body(resp, started)

    def _read_body(self, resp: requests.Response, started: float) -> bytes:
        lim = self.limits
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                chunk = resp.raw.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > lim.max_bytes:
                    raise _Failure("too_big", f"page is larger than the {lim.max_bytes} byte cap; stopped reading",
                                   resp.status_code)
                chunks.append(chunk)
                if time.monotonic() - started > lim.deadline:
                    raise _Failure("trickle", f"page not complete after {lim.deadline:g}s ({size} bytes so far): "
                                   "the server is sending too slowly", resp.status_code)
        except (urllib3.exceptions.HTTPError, requests.exceptions.RequestException, OSError) as e:
            timed_out = isinstance(e, urllib3.exceptions.ReadTimeoutError | TimeoutError)
            kind = NO_ANSWER if timed_out else "truncated"
            raise _Failure(kind, f"reading the page failed after {size} bytes: {_short(str(e))}") from None
        return b"".join(chunks)


class _Failure(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
