"""The one HTTP session to the engine, with its caps: every request the watchdog sends to vLLM goes through here.

The scrape, the probe, the proof after a restart, and the evidence's page and version reads share one
``requests.Session`` with ``trust_env`` off (no proxy or netrc from the environment: the engine is spoken to
directly), bounded redirects, a connect and a read timeout on every request, a deadline for the whole body and a
byte cap on what is read. A failure is an `HttpFailure` with a short stable ``kind`` the callers map to meaning.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests
import urllib3

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
        self._closers: list[Callable[[], None]] = []

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
            data = self._read_body(resp, what, started, deadline, lim.max_bytes if max_bytes is None else max_bytes)
            return Reply(resp.status_code, resp.headers.get("Content-Type", ""), data)

    def _read_body(self, resp: requests.Response, what: str, started: float, deadline: float, cap: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                chunk = resp.raw.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > cap:
                    raise HttpFailure("too_big", f"{what} is larger than the {cap} byte cap; stopped reading",
                                      resp.status_code)
                chunks.append(chunk)
                if time.monotonic() - started > deadline:
                    raise HttpFailure("trickle", f"{what} not complete after {deadline:g}s ({size} bytes so far): "
                                      "the server is sending too slowly", resp.status_code)
        except (urllib3.exceptions.HTTPError, requests.exceptions.RequestException, OSError) as e:
            timed_out = isinstance(e, urllib3.exceptions.ReadTimeoutError | TimeoutError)
            kind = NO_ANSWER if timed_out else "truncated"
            raise HttpFailure(kind, f"reading {what} failed after {size} bytes: {short(str(e))}") from None
        return b"".join(chunks)

    @property
    def auth_headers(self) -> dict[str, str]:
        return dict(self._auth)

    def close_with(self, close: Callable[[], None]) -> None:
        """Close something else that speaks to the engine (the scrape's own socket) when this session closes."""
        self._closers.append(close)

    def close(self) -> None:
        self.session.close()
        for close in self._closers:
            close()


def short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."

