"""The one HTTP client of the engine, with its caps: every request the watchdog sends to vLLM goes through here.

The 1 Hz scrape of ``/metrics`` (`EngineHTTP.get_page`), the probe, the proof after a restart, and the evidence's
page and version reads share one urllib3 pool (no proxy or netrc from the environment: the engine is spoken to
directly), its connections kept alive. urllib3 itself, not requests over it: requests' layer costs about 0.5 ms more
CPU a GET, cold (1.5 ms instead of 1.0 for the filtered page, docs/benchmarks.md). Every request has the same caps:
bounded redirects, a connect and a read timeout, a deadline for the whole body and a byte cap on what is read. A
failure is an `HttpFailure` with a short stable ``kind`` the callers map to meaning, made by one function
(`_failure`) from the exception's type.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import urllib3
from requests.utils import DEFAULT_CA_BUNDLE_PATH  # certifi's bundle: the CAs the engine's TLS is checked against
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
# connections kept per origin: the scrape, a probe, the evidence thread's reads and a restart's proof may overlap
POOL_SIZE = 4


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


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One request's URL (without its query: the scrape's filter is no part of what a failure says), what its body
    is called in a failure, when it began, and its caps."""

    url: str
    what: str
    started: float
    timeout: urllib3.Timeout
    deadline: float
    cap: int
    max_redirects: int


class EngineHTTP:
    """The engine's base URL and the one connection pool to it. Safe to share between the loop and its helper
    threads (the pool is thread-safe; nothing here keeps per-request state)."""

    def __init__(self, url: str, limits: HttpLimits | None = None, api_key: str = "") -> None:
        self.base = base_url(url)
        self.limits = lim = limits or HttpLimits()
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pool = urllib3.PoolManager(num_pools=4, maxsize=POOL_SIZE, cert_reqs="CERT_REQUIRED",
                                         ca_certs=DEFAULT_CA_BUNDLE_PATH)
        self._timeout = _timeout(lim, lim.read_timeout)
        self._retries = _Retry(total=None, connect=False, read=1, other=0, status=0, redirect=lim.max_redirects,
                               raise_on_redirect=True, raise_on_status=False)

    def get_page(self, path: str, *, accept: str = "text/plain") -> Reply:
        """A GET of the page (``/metrics``, filtered or whole) with the limits as they are."""
        return self.request("GET", path, accept=accept)

    def get(self, path: str, *, accept: str = "*/*", read_timeout: float | None = None,
            max_bytes: int | None = None) -> Reply:
        return self.request("GET", path, accept=accept, read_timeout=read_timeout, max_bytes=max_bytes)

    def post_json(self, path: str, body: dict[str, Any], *, read_timeout: float | None = None) -> Reply:
        return self.request("POST", path, body=body, accept="application/json", read_timeout=read_timeout)

    def request(self, method: str, path: str, *, body: dict[str, Any] | None = None, accept: str = "*/*",
                read_timeout: float | None = None, max_bytes: int | None = None) -> Reply:
        """``read_timeout`` (a generation's): the wait for the answer, and the least deadline for its body."""
        lim = self.limits
        url = self.base + path
        headers = {"Accept-Encoding": "identity", "Accept": accept, "User-Agent": "engine-watchdog", **self._auth}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        at = _Attempt(url.split("?", 1)[0], "the page" if path.startswith("/metrics") else url, time.monotonic(),
                      self._timeout if read_timeout is None else _timeout(lim, read_timeout),
                      lim.deadline if read_timeout is None else max(lim.deadline, read_timeout),
                      lim.max_bytes if max_bytes is None else max_bytes, lim.max_redirects)
        try:
            resp = self._pool.urlopen(method, url, body=data, headers=headers, timeout=at.timeout,
                                      retries=self._retries, preload_content=False, decode_content=False)
        except urllib3.exceptions.HTTPError as e:
            raise _failure(e, at) from None
        try:
            content = _read_body(resp, at)
        except HttpFailure:
            resp.close()  # the connection is dropped, not read on to the end
            raise
        finally:
            resp.release_conn()
        return Reply(resp.status, resp.headers.get("Content-Type", ""), content)

    def close(self) -> None:
        self._pool.clear()


def _timeout(lim: HttpLimits, read: float) -> urllib3.Timeout:
    return urllib3.Timeout(connect=min(lim.connect_timeout, read), read=read)


class _Retry(urllib3.Retry):
    """Redirects up to the cap; one more try on a fresh connection when the connection closed before the answer
    began (a kept-alive one the server dropped as the request went; urllib3 never retries a POST so); none after a
    timeout (the read timeout is waited once) or a failed connect. Any status is an answer."""

    def increment(self, method: str | None = None, url: str | None = None,
                  response: urllib3.BaseHTTPResponse | None = None, error: Exception | None = None,
                  _pool: urllib3.connectionpool.ConnectionPool | None = None,
                  _stacktrace: TracebackType | None = None) -> Self:
        if isinstance(error, ReadTimeoutError):
            raise error
        return super().increment(method, url, response, error, _pool, _stacktrace)


def _read_body(resp: urllib3.BaseHTTPResponse, at: _Attempt) -> bytes:
    """The body, read as it comes, up to the byte cap and the deadline for the whole of it."""
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := resp.read1(65536):
            size += len(chunk)
            if size > at.cap:
                raise HttpFailure("too_big", f"{at.what} is larger than the {at.cap} byte cap; stopped reading",
                                  resp.status)
            chunks.append(chunk)
            if time.monotonic() - at.started > at.deadline:
                raise HttpFailure("trickle", f"{at.what} not complete after {at.deadline:g}s ({size} bytes so far): "
                                  "the server is sending too slowly", resp.status)
    except (urllib3.exceptions.HTTPError, OSError) as e:
        raise _failure(e, at, size) from None
    return b"".join(chunks)


def _failure(e: Exception, at: _Attempt, body_read: int | None = None) -> HttpFailure:
    """The failure ``e`` as a kind and words, by its type: before any answer, or (``body_read``: the bytes of the body
    read so far) while the body was read."""
    if body_read is not None:
        kind = NO_ANSWER if isinstance(e, ReadTimeoutError | TimeoutError) else "truncated"
        return HttpFailure(kind, f"reading {at.what} failed after {body_read} bytes: {short(str(e))}")
    url = at.url
    if isinstance(e, MaxRetryError):
        if isinstance(e.reason, ResponseError):
            return HttpFailure("redirects", f"{url} redirects more than {at.max_redirects} times")
        e = e.reason or e
    if isinstance(e, NewConnectionError):  # before ConnectTimeoutError, its base class
        if isinstance(e.__cause__, ConnectionRefusedError):
            return HttpFailure("refused", f"nothing listening at {url} (connection refused)")
        return HttpFailure("unreachable", f"cannot reach {url}: {short(str(e))}")
    if isinstance(e, ConnectTimeoutError):
        return HttpFailure("unreachable", f"no TCP connection to {url} within {at.timeout.connect_timeout:g}s")
    if isinstance(e, ReadTimeoutError):
        return HttpFailure(NO_ANSWER, f"{url} accepted the connection but sent no response within "
                           f"{at.timeout.read_timeout:g}s")
    if isinstance(e, ProtocolError):
        cause = e.args[1] if len(e.args) > 1 else None
        if isinstance(cause, http.client.HTTPException) and not isinstance(cause, http.client.RemoteDisconnected):
            return HttpFailure("unreachable", f"{url} did not answer HTTP: {short(str(cause), 80)}")
        return HttpFailure(LOST, f"{url}: the connection closed after {time.monotonic() - at.started:.1f}s "
                           "without an answer")
    return HttpFailure("unreachable", f"request to {url} failed: {short(str(e))}")


def short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
