"""A small HTTP/1.1 keep-alive GET over one socket, for the 1 Hz scrape of ``/metrics`` only.

Measured (bench/profile_tick.py): through requests/urllib3 a GET of the 53 KB page costs about 0.5 ms of CPU, more
than reading the page; this client costs about 0.05 ms. Everything else (probe, versions, the evidence's reads)
stays on requests through `EngineHTTP`. Same caps and the same `HttpFailure` kinds and messages as `EngineHTTP`:
a connect and a read timeout, a deadline for the whole body, a byte cap (the connection is dropped at the cap),
bounded redirects (followed only to plain http), Content-Length, chunked and read-to-close framing.
tests/unit/test_scrape_bad_input.py runs against it, and tests/unit/test_http_client.py checks that it returns
the same bytes as requests for real pages, chunked included.

Not thread-safe: one caller (the watch loop) owns it.
"""

from __future__ import annotations

import errno
import re
import socket
import struct
import time
from urllib.parse import urljoin, urlsplit

from watchdog.core.types import NO_ANSWER, HttpLimits
from watchdog.scrape.engine_http import LOST, HttpFailure, Reply, short
from watchdog.scrape.http1_body import BodyReader, Broken, Stale, recv, send

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HEADER = re.compile(r"\r\n([^:\r\n]*):([^\r\n]*)")  # each header line after the status line: name, value
_MAX_HEAD = 65536  # status line and headers; more is not an HTTP server we want to read
# The one header of a scrape's answer that changes from one answer to the next: without it, a head seen before
# (status, headers, framing) is known, and its reading is reused (see `PageClient._known_head`)
_DATE = re.compile(rb"\r\ndate:[^\r\n]*", re.IGNORECASE)
_KNOWN_MAX = 8


class _Head:
    __slots__ = ("headers", "keep_alive", "status")

    def __init__(self, status: int, headers: dict[str, str], keep_alive: bool) -> None:
        self.status, self.headers, self.keep_alive = status, headers, keep_alive


class PageClient:
    """GETs of one plain-http origin on a kept-alive socket, reconnecting when the server closed it."""

    def __init__(self, base: str, limits: HttpLimits, headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(base)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"PageClient speaks plain http only, not {base!r}")
        self.base = base
        self.limits = limits
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._origin = (parts.hostname, parts.port or 80)
        self._sock: socket.socket | None = None
        self._sock_origin: tuple[str, int] | None = None
        self._buf = b""  # bytes read past the last response (none from a well-behaved server)
        self._requests: dict[tuple[str, str], bytes] = {}  # (url, accept) -> the request's bytes, built once
        self._timeout: float | None = None  # the socket's SO_RCVTIMEO/SO_SNDTIMEO as last set
        self._known: dict[bytes, _Head] = {}  # a head without its Date line -> its reading (200, chunked, kept alive)

    # -- the one call ----------------------------------------------------------------------------------

    def get(self, path: str, *, accept: str = "*/*") -> Reply:
        lim = self.limits
        url = self.base + path
        read, connect = lim.read_timeout, min(lim.connect_timeout, lim.read_timeout)
        started = time.monotonic()
        what = "the page" if path.startswith("/metrics") else url
        origin = self._origin
        first = self._quick(url, accept, what, started)
        if isinstance(first, Reply):
            return first
        for hop in range(lim.max_redirects + 1):
            head, sock = first if hop == 0 and first is not None else self._exchange(origin, url, accept, connect,
                                                                                      read, started)
            if head.status in _REDIRECTS and "location" in head.headers:
                self._skip_body(sock, head, what, started)
                if hop == lim.max_redirects:
                    raise HttpFailure("redirects", f"{self.base + path} redirects more than {lim.max_redirects} times")
                url = urljoin(url, head.headers["location"])
                target = urlsplit(url)
                if target.scheme != "http" or not target.hostname:
                    self.close()
                    raise HttpFailure("redirects", f"{self.base + path} redirects to {short(url)}: the scrape follows "
                                      "redirects on plain http only")
                origin = (target.hostname, target.port or 80)
                continue
            body = self._body(sock, head, what, started, lim.deadline, lim.max_bytes)
            if not head.keep_alive:
                self.close()
            return Reply(head.status, head.headers.get("content-type", ""), body)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _quick(self, url: str, accept: str, what: str, started: float) -> Reply | tuple[_Head, socket.socket] | None:
        """The common case in few steps: the kept-alive socket, the request already built, one send, a 200 read at
        once. Another answer's head goes back to `get`, whose loop goes on from it; None when the request was not
        sent here or the kept-alive socket turned out closed (then `get` sends it fresh, as `_exchange` would)."""
        sock, request, read = self._sock, self._requests.get((url, accept)), self.limits.read_timeout
        if sock is None or request is None or self._sock_origin != self._origin or self._buf or self._timeout != read:
            return None
        try:
            send(sock, request)
            head = self._head(sock, url, read, started)
        except Stale:  # the server closed the idle connection: sent again on a fresh one
            self.close()
            return None
        except TimeoutError:
            raise self._no_answer(url, read) from None
        except HttpFailure:
            self.close()
            raise
        if head.status != 200:
            return head, sock
        body = self._body(sock, head, what, started, self.limits.deadline, self.limits.max_bytes)
        if not head.keep_alive:
            self.close()
        return Reply(200, head.headers.get("content-type", ""), body)

    def _no_answer(self, url: str, read: float) -> HttpFailure:
        self.close()
        return HttpFailure(NO_ANSWER, f"{url} accepted the connection but sent no response within {read:g}s")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._sock_origin, self._buf = None, None, b""

    # -- connection ------------------------------------------------------------------------------------

    def _connect(self, origin: tuple[str, int], url: str, connect: float) -> socket.socket:
        self.close()
        try:
            sock = socket.create_connection(origin, timeout=connect)
        except TimeoutError:
            raise HttpFailure("unreachable", f"no TCP connection to {url} within {connect:g}s") from None
        except ConnectionRefusedError:
            raise HttpFailure("refused", f"nothing listening at {url} (connection refused)") from None
        except OSError as e:
            raise HttpFailure("unreachable", f"cannot reach {url}: {short(str(e))}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking, with the read timeout kept by the kernel: a socket with a Python timeout polls before every send
        # and receive (two more system calls a scrape, each ~50 us of CPU when cold, measured)
        sock.settimeout(None)
        self._sock, self._sock_origin, self._timeout = sock, origin, None
        return sock

    def _kernel_timeout(self, sock: socket.socket, seconds: float) -> None:
        if self._timeout != seconds:
            whole = int(seconds)
            tv = struct.pack("ll", whole, max(1 if whole == 0 else 0, int((seconds - whole) * 1e6)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._timeout = seconds

    def _reusable(self, origin: tuple[str, int]) -> socket.socket | None:
        """The kept-alive socket, unless it is for another origin or bytes are left over from the last answer. One
        the server closed meanwhile shows as an answer with no byte, retried once on a fresh connection (no poll
        before each scrape: a system call saved)."""
        sock = self._sock
        if sock is None or self._sock_origin != origin or self._buf:
            return None
        return sock

    def _exchange(self, origin: tuple[str, int], url: str, accept: str, connect: float,
                  read: float, started: float) -> tuple[_Head, socket.socket]:
        """Send the request and read the head; a kept-alive socket the server dropped gets one fresh retry."""
        request = self._requests.get((url, accept))
        if request is None:
            request = self._request(url, accept)
        sock = self._reusable(origin)
        reused = sock is not None
        if sock is None:
            sock = self._connect(origin, url, connect)
        while True:
            try:
                self._kernel_timeout(sock, read)
                send(sock, request)
                return self._head(sock, url, read, started), sock
            except Stale:
                if not reused:
                    self.close()
                    raise HttpFailure(LOST, f"{url}: the connection closed after {time.monotonic() - started:.1f}s "
                                      "without an answer") from None
                reused = False  # the server closed the idle connection as we sent: once more, fresh
                sock = self._connect(origin, url, connect)
            except TimeoutError:
                raise self._no_answer(url, read) from None
            except HttpFailure:
                self.close()
                raise

    def _request(self, url: str, accept: str) -> bytes:
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = (f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: {accept}\r\n"
                   f"Accept-Encoding: identity\r\nUser-Agent: engine-watchdog\r\n{self._extra}\r\n").encode("latin-1")
        if len(self._requests) >= 16:  # redirect targets are few; never let them grow without bound
            self._requests.clear()
        self._requests[url, accept] = request
        return request

    def _head(self, sock: socket.socket, url: str, read: float, started: float, buf: bytes = b"") -> _Head:
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head_bytes, self._buf = buf[:end], buf[end + 4:]
                head = self._known_head(head_bytes, url)
                if 100 <= head.status < 200:  # 100 Continue and friends: the real answer follows
                    buf, self._buf = self._buf, b""
                    continue
                return head
            if len(buf) > _MAX_HEAD:
                raise HttpFailure("unreachable", f"{url}: no end of the HTTP headers within {_MAX_HEAD} bytes")
            try:
                chunk = recv(sock)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            except OSError as e:
                if isinstance(e, TimeoutError):
                    raise
                if e.errno in (errno.ECONNRESET, errno.EPIPE):
                    chunk = b""
                else:
                    raise HttpFailure("unreachable", f"request to {url} failed: {short(str(e))}") from None
            if not chunk:
                if buf:
                    raise HttpFailure(LOST, f"{url}: the connection closed after {time.monotonic() - started:.1f}s "
                                      "inside the HTTP headers")
                raise Stale
            buf += chunk

    def _known_head(self, raw: bytes, url: str) -> _Head:
        """The head's reading, reused when the same head (but its Date) was read before. Kept only for a 200 that is
        chunked and kept alive: its reading is never changed by the body's (a body read to the close changes
        ``keep_alive``), and nothing reads the date. Measured with the caches flushed before each GET of the
        filtered page (a busy engine leaves them so), with `BodyReader.one_chunk`: 223-225 us of CPU a GET instead
        of 248-268; a bare socket's GET, 142-155 us."""
        key = _DATE.sub(b"", raw)
        head = self._known.get(key)
        if head is None:
            head = self._parse_head(raw, url)
            chunked = "chunked" in head.headers.get("transfer-encoding", "").lower()
            if head.status == 200 and head.keep_alive and chunked:
                if len(self._known) >= _KNOWN_MAX:
                    self._known.clear()
                self._known[key] = head
        return head

    @staticmethod
    def _parse_head(raw: bytes, url: str) -> _Head:
        text = raw.decode("latin-1")
        first, _, _rest = text.partition("\r\n")
        status_line = first.split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or not status_line[1].isdigit():
            raise HttpFailure("unreachable", f"{url} did not answer HTTP: {short(first, 80)!r}")
        headers: dict[str, str] = {}
        for name, raw_value in _HEADER.findall(text):  # one C scan for every header line
            key = name.strip().lower()
            value = raw_value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers and key != "content-length" else value
        conn = headers.get("connection", "").lower()
        keep = ("close" not in conn) if status_line[0] != "HTTP/1.0" else ("keep-alive" in conn)
        return _Head(int(status_line[1]), headers, keep)

    # -- body ------------------------------------------------------------------------------------------

    def _skip_body(self, sock: socket.socket, head: _Head, what: str, started: float) -> None:
        self._body(sock, head, what, started, self.limits.deadline, self.limits.max_bytes)
        if not head.keep_alive:
            self.close()

    def _body(self, sock: socket.socket, head: _Head, what: str, started: float, deadline: float, cap: int) -> bytes:
        status = head.status
        if status in (204, 304):
            return b""
        te = head.headers.get("transfer-encoding", "").lower()
        length_text = head.headers.get("content-length")
        reader = BodyReader(sock, self._buf, what, started, deadline, cap, status)
        self._buf = b""
        try:
            if "chunked" in te:
                one = reader.one_chunk()
                body = one if one is not None else reader.chunked()
            elif length_text is not None:
                try:
                    length = int(length_text)
                    if length < 0:
                        raise ValueError(length_text)
                except ValueError:
                    raise Broken(f"bad Content-Length {short(length_text, 40)!r}") from None
                body = reader.exact(length)
            else:
                head.keep_alive = False  # no framing: the body ends when the server closes
                body = reader.to_close()
            self._buf = reader.buf
            return body
        except TimeoutError:
            self.close()
            raise HttpFailure(NO_ANSWER, f"reading {what} failed after {reader.got} bytes: "
                              f"read timed out ({self.limits.read_timeout:g}s)") from None
        except Broken as e:
            self.close()
            raise HttpFailure("truncated", f"reading {what} failed: {short(str(e))}") from None
        except HttpFailure:
            self.close()
            raise
        except OSError as e:
            self.close()
            raise HttpFailure("truncated", f"reading {what} failed: {short(str(e))}") from None


