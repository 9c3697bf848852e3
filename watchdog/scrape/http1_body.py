"""The body of one HTTP/1.1 answer on a blocking socket, for `watchdog.scrape.http1.PageClient`: Content-Length,
chunked or read-to-close framing, under a byte cap and a deadline for the whole body.

The socket blocks with the kernel's timeouts (SO_RCVTIMEO/SO_SNDTIMEO): a timeout shows as EAGAIN, raised here as
``TimeoutError`` as a Python timeout would be. A body whose framing breaks raises `Broken`; the caller turns both
into `HttpFailure` kinds and drops the connection.
"""

from __future__ import annotations

import re
import socket
import time

from watchdog.scrape.engine_http import HttpFailure

RECV = 65536
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")  # a chunk size with no extension


class Broken(Exception):
    """The body's framing broke: the connection closed early or the framing is malformed."""


class Stale(Exception):
    """The connection closed before a byte of the answer."""


def recv(sock: socket.socket) -> bytes:
    """A receive on the blocking socket; the kernel's timeout (EAGAIN) is a TimeoutError as on a Python timeout."""
    try:
        return sock.recv(RECV)
    except BlockingIOError:
        raise TimeoutError from None


def send(sock: socket.socket, data: bytes) -> None:
    """A send on the blocking socket; a connection the server closed while it idled is stale (retried once)."""
    try:
        sock.sendall(data)
    except BlockingIOError:
        raise TimeoutError from None
    except (BrokenPipeError, ConnectionResetError):
        raise Stale from None


class BodyReader:
    """Reads one body. ``buf`` holds the bytes read past the head (on entry) and past the body (on return); ``got``
    counts the body's bytes so far, for the messages."""

    __slots__ = ("buf", "cap", "deadline", "got", "sock", "started", "status", "what")

    def __init__(self, sock: socket.socket, buf: bytes, what: str, started: float, deadline: float, cap: int,
                 status: int) -> None:
        self.sock, self.buf, self.what, self.started = sock, buf, what, started
        self.deadline, self.cap, self.status = deadline, cap, status
        self.got = 0

    def check(self, size: int) -> None:
        self.got = size
        if size > self.cap:
            raise HttpFailure("too_big", f"{self.what} is larger than the {self.cap} byte cap; stopped reading",
                              self.status)
        if time.monotonic() - self.started > self.deadline:
            raise HttpFailure("trickle", f"{self.what} not complete after {self.deadline:g}s ({size} bytes so far): "
                              "the server is sending too slowly", self.status)

    def exact(self, length: int) -> bytes:
        """A body of ``length`` bytes (Content-Length). Declared larger than the cap: read up to the cap, as the
        streaming reader would, and fail there."""
        cap = self.cap
        to_read = cap + 1 if length > cap else length
        if len(self.buf) >= to_read and length <= cap:  # the whole body came with the head: no copy
            body, self.buf = self.buf[:length], self.buf[length:]
            self.check(length)
            return body
        out = bytearray(to_read)
        view = memoryview(out)
        got = min(len(self.buf), to_read)
        view[:got] = self.buf[:got]
        self.buf = self.buf[got:]
        self.check(got)
        while got < to_read:
            try:
                n = self.sock.recv_into(view[got:], min(RECV, to_read - got))
            except BlockingIOError:
                raise TimeoutError from None
            if n == 0:
                raise Broken(f"Connection broken: IncompleteRead({got} bytes read, {length - got} more expected)")
            got += n
            self.check(got)
        return bytes(out)

    def to_close(self) -> bytes:
        """No framing: the body ends when the server closes the connection."""
        chunks = [self.buf] if self.buf else []
        self.buf = b""
        size = sum(len(c) for c in chunks)
        self.check(size)
        while chunk := recv(self.sock):
            chunks.append(chunk)
            size += len(chunk)
            self.check(size)
        return b"".join(chunks)

    def one_chunk(self) -> bytes | None:
        """The common chunked body in one step: one chunk and the last, nothing after them, all in hand (received
        here when nothing of the body came with the head, as `chunked` would). None: `chunked` reads it, from what
        is in ``buf`` now."""
        if not self.buf:
            self._fill(1, 0)
        buf = self.buf
        eol = buf.find(b"\r\n")
        if eol < 1 or not buf.endswith(b"\r\n0\r\n\r\n") or _HEX.fullmatch(buf, 0, eol) is None:
            return None
        n = int(buf[:eol], 16)
        if n == 0 or n > self.cap or len(buf) != eol + n + 9:  # size line, chunk, CRLF, "0" CRLF CRLF
            return None
        self.buf = b""
        self.check(n)
        return buf[eol + 2 : eol + 2 + n]

    def chunked(self) -> bytes:
        """Transfer-Encoding: chunked, trailers skipped."""
        chunks: list[bytes] = []
        size = 0
        while True:
            while (eol := self.buf.find(b"\r\n")) < 0:
                if len(self.buf) > 1024:
                    raise Broken("Connection broken: InvalidChunkLength (no end of the chunk size line)")
                self._fill(len(self.buf) + 1, size)
            size_text = self.buf[:eol].split(b";", 1)[0].strip()
            try:
                n = int(size_text, 16)
                if n < 0:
                    raise ValueError
            except ValueError:
                raise Broken(f"Connection broken: InvalidChunkLength(got length b{size_text[:20]!r}), "
                             f"IncompleteRead({size} bytes read)") from None
            self.buf = self.buf[eol + 2:]
            if n == 0:
                self._trailers(size)
                return b"".join(chunks)
            if size + n > self.cap:
                raise HttpFailure("too_big", f"{self.what} is larger than the {self.cap} byte cap; stopped reading",
                                  self.status)
            self._fill(n + 2, size)
            chunks.append(self.buf[:n])
            if self.buf[n:n + 2] != b"\r\n":
                raise Broken("Connection broken: chunk not followed by CRLF")
            self.buf = self.buf[n + 2:]
            size += n
            self.check(size)

    def _trailers(self, size: int) -> None:
        """The trailers after the last chunk, up to the empty line; what follows stays in ``buf``."""
        while True:
            while (eol := self.buf.find(b"\r\n")) < 0:
                self._fill(len(self.buf) + 1, size)
            line, self.buf = self.buf[:eol], self.buf[eol + 2:]
            if not line:
                return

    def _fill(self, need_at_least: int, size: int) -> None:
        while len(self.buf) < need_at_least:
            more = recv(self.sock)
            if not more:
                raise Broken(f"Connection broken: IncompleteRead({size} bytes read)")
            self.buf += more
            if time.monotonic() - self.started > self.deadline:
                raise HttpFailure("trickle", f"{self.what} not complete after {self.deadline:g}s "
                                  f"({size + len(self.buf)} bytes so far): the server is sending too slowly",
                                  self.status)
