"""The one HTTP session to the engine, with its caps: every request the watchdog sends to vLLM goes through here.

The probe, the proof after a restart, and the evidence's page and version reads share one ``requests.Session``
with ``trust_env`` off (no proxy or netrc from the environment: the engine is spoken to directly); the 1 Hz scrape
of ``/metrics`` (`EngineHTTP.get_page`) goes through urllib3 itself, on one kept-alive connection: requests' layer
over urllib3 costs about 0.5 ms more CPU a GET, cold (1.5 ms instead of 1.0, the filtered page; 0.05 % of a core
at 1 Hz). Both have the same caps: bounded redirects, a connect and a read timeout on every request, a deadline for the
whole body and a byte cap on what is read. A failure is an `HttpFailure` with a short stable ``kind`` the callers
map to meaning.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import requests
import urllib3
from requests.utils import DEFAULT_CA_BUNDLE_PATH
from urllib3.exceptions import (
    ConnectTimeoutError,
    MaxRetryError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    ResponseError,
)

from watchdog.core.types import NO_ANSWER, HttpLimits, base_url

log = logging.getLogger(__name__)

LOST = "lost"  # the connection closed before any answer: the server (or its worker) died mid-request


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return json.loads(self.body)

    def text(self, limit: int = 160) -> str:
        return self.body[:limit].decode("utf-8", "replace").strip()


class HttpFailure(Exception):
    """No usable answer. ``kind``: refused, unreachable, no_answer, lost, redirects, too_big, trickle, truncated."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status


class EngineHTTP:
    """The engine's base URL and the one session to it. Safe to share between the loop and its helper threads
    (the connection pool is thread-safe; nothing here keeps per-request state)."""

    def __init__(self, url: str, limits: HttpLimits | None = None, api_key: str = "",
                 session: requests.Session | None = None) -> None:
        self.base = base_url(url)
        self.limits = limits or HttpLimits()
        self.session = session or requests.Session()
        self.session.max_redirects = self.limits.max_redirects
        self.session.trust_env = False
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # the scrape's pool: one kept-alive connection per origin, verified against the CA bundle requests uses
        self._pages = urllib3.PoolManager(num_pools=4, maxsize=1, cert_reqs="CERT_REQUIRED",
                                          ca_certs=DEFAULT_CA_BUNDLE_PATH)
        lim = self.limits
        self._connect_read = (min(lim.connect_timeout, lim.read_timeout), lim.read_timeout)
        self._page_timeout = urllib3.Timeout(connect=self._connect_read[0], read=self._connect_read[1])
        self._page_retries = _PageRetry(total=None, connect=False, read=1, other=0, status=0,
                                        redirect=lim.max_redirects, raise_on_redirect=True, raise_on_status=False)

    def get(self, path: str, *, accept: str = "*/*", read_timeout: float | None = None,
            max_bytes: int | None = None) -> Reply:
        return self.request("GET", path, accept=accept, read_timeout=read_timeout, max_bytes=max_bytes)

    def post_json(self, path: str, body: dict[str, Any], *, read_timeout: float | None = None) -> Reply:
        return self.request("POST", path, body=body, accept="application/json", read_timeout=read_timeout)

    def request(self, method: str, path: str, *, body: dict[str, Any] | None = None, accept: str = "*/*",
                read_timeout: float | None = None, max_bytes: int | None = None) -> Reply:
        lim = self.limits
        url = self.base + path
        read = lim.read_timeout if read_timeout is None else read_timeout
        connect = min(lim.connect_timeout, read)
        started = time.monotonic()
        headers = {"Accept-Encoding": "identity", "Accept": accept, **self._auth}
        try:
            resp = self.session.request(method, url, json=body, timeout=(connect, read), stream=True,
                                        headers=headers)
        except requests.exceptions.ConnectTimeout:
            raise HttpFailure("unreachable", f"no TCP connection to {url} within {connect:g}s") from None
        except requests.exceptions.ReadTimeout:
            raise HttpFailure(NO_ANSWER, f"{url} accepted the connection but sent no response within "
                              f"{read:g}s") from None
        except requests.exceptions.TooManyRedirects:
            raise HttpFailure("redirects", f"{url} redirects more than {lim.max_redirects} times") from None
        except requests.exceptions.ConnectionError as e:
            text = str(e)
            if "Connection refused" in text or "ECONNREFUSED" in text:
                raise HttpFailure("refused", f"nothing listening at {url} (connection refused)") from None
            if "Read timed out" in text:
                raise HttpFailure(NO_ANSWER, f"{url}: no answer within {read:g}s") from None
            if "RemoteDisconnected" in text or "Connection aborted" in text:
                raise HttpFailure(LOST, f"{url}: the connection closed after {time.monotonic() - started:.1f}s "
                                  "without an answer") from None
            raise HttpFailure("unreachable", f"cannot reach {url}: {short(text)}") from None
        except requests.exceptions.RequestException as e:
            raise HttpFailure("unreachable", f"request to {url} failed: {short(str(e))}") from None
        with resp:
            what = "the page" if path.startswith("/metrics") else url
            deadline = lim.deadline if read_timeout is None else max(lim.deadline, read_timeout)
            data = _read_body(resp.raw, resp.status_code, what, started, deadline,
                              lim.max_bytes if max_bytes is None else max_bytes)
            return Reply(resp.status_code, resp.headers.get("Content-Type", ""), data)

    def get_page(self, path: str, *, accept: str = "text/plain") -> Reply:
        """A GET of the scrape (``/metrics``, filtered or whole) through the scrape's kept-alive connection, with the
        limits' timeouts, deadline and byte cap. Called by one thread, the watch loop's."""
        lim = self.limits
        url = self.base + path
        started = time.monotonic()
        headers = {"Accept-Encoding": "identity", "Accept": accept, "User-Agent": "engine-watchdog", **self._auth}
        try:
            resp = self._pages.urlopen("GET", url, headers=headers, timeout=self._page_timeout,
                                       retries=self._page_retries, preload_content=False, decode_content=False)
        except urllib3.exceptions.HTTPError as e:
            raise self._page_failure(e, url.split("?", 1)[0], started) from None  # the page's URL, not the filter
        try:
            data = _read_body(resp, resp.status, "the page", started, lim.deadline, lim.max_bytes)
        except HttpFailure:
            resp.close()  # the connection is dropped, not read on to the end
            raise
        finally:
            resp.release_conn()
        return Reply(resp.status, resp.headers.get("Content-Type", ""), data)

    def _page_failure(self, e: Exception, url: str, started: float) -> HttpFailure:
        """The failure of `get_page` before an answer, in the kinds and words of `request`."""
        if isinstance(e, MaxRetryError):
            if isinstance(e.reason, ResponseError):
                return HttpFailure("redirects", f"{url} redirects more than {self.limits.max_redirects} times")
            e = e.reason or e
        connect, read = self._connect_read
        if isinstance(e, NewConnectionError):
            if isinstance(e.__cause__, ConnectionRefusedError):
                return HttpFailure("refused", f"nothing listening at {url} (connection refused)")
            return HttpFailure("unreachable", f"cannot reach {url}: {short(str(e))}")
        if isinstance(e, ConnectTimeoutError):
            return HttpFailure("unreachable", f"no TCP connection to {url} within {connect:g}s")
        if isinstance(e, ReadTimeoutError):
            return HttpFailure(NO_ANSWER, f"{url} accepted the connection but sent no response within {read:g}s")
        if isinstance(e, ProtocolError):
            cause = e.args[1] if len(e.args) > 1 else None
            if isinstance(cause, http.client.HTTPException) and not isinstance(cause, http.client.RemoteDisconnected):
                return HttpFailure("unreachable", f"{url} did not answer HTTP: {short(str(cause), 80)}")
            return HttpFailure(LOST, f"{url}: the connection closed after {time.monotonic() - started:.1f}s "
                               "without an answer")
        return HttpFailure("unreachable", f"request to {url} failed: {short(str(e))}")

    def close(self) -> None:
        self.session.close()
        self._pages.clear()


class _PageRetry(urllib3.Retry):
    """The scrape's retries: redirects up to the cap; one more try on a fresh connection when the connection closed
    before the answer began (a kept-alive one the server dropped as the request went); none after a timeout (the
    read timeout is waited once) or a failed connect. Any status is an answer."""

    def increment(self, method: str | None = None, url: str | None = None,
                  response: urllib3.BaseHTTPResponse | None = None, error: Exception | None = None,
                  _pool: urllib3.connectionpool.ConnectionPool | None = None,
                  _stacktrace: TracebackType | None = None) -> Self:
        if isinstance(error, ReadTimeoutError):
            raise error
        return super().increment(method, url, response, error, _pool, _stacktrace)


def _read_body(raw: urllib3.BaseHTTPResponse, status: int, what: str, started: float, deadline: float,
               cap: int) -> bytes:
    """The body, read as it comes, up to the byte cap and the deadline for the whole of it."""
    chunks: list[bytes] = []
    size = 0
    try:
        while True:
            chunk = raw.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > cap:
                raise HttpFailure("too_big", f"{what} is larger than the {cap} byte cap; stopped reading", status)
            chunks.append(chunk)
            if time.monotonic() - started > deadline:
                raise HttpFailure("trickle", f"{what} not complete after {deadline:g}s ({size} bytes so far): "
                                  "the server is sending too slowly", status)
    except (urllib3.exceptions.HTTPError, requests.exceptions.RequestException, OSError) as e:
        kind = NO_ANSWER if isinstance(e, ReadTimeoutError | TimeoutError) else "truncated"
        raise HttpFailure(kind, f"reading {what} failed after {size} bytes: {short(str(e))}") from None
    return b"".join(chunks)


def short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."

