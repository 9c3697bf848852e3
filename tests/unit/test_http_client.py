"""The scrape's hand-written HTTP/1.1 client (watchdog/scrape/http1.py) agrees with requests.

Real pages are served by a real HTTP server on loopback, with Content-Length, chunked (in small and odd-sized
chunks, with a chunk extension and a trailer), and read-to-close framing; the client must return the same status,
content type and bytes as a plain requests GET of the same URL. Keep-alive: consecutive GETs reuse one connection,
and a connection the server closed meanwhile is replaced without a failure. The error cases are in
test_scrape_bad_input.py, which runs through this client (MetricsFetcher uses it for http URLs).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from watchdog.core.types import HttpLimits
from watchdog.scrape.engine_http import EngineHTTP, HttpFailure
from watchdog.scrape.fetch import MetricsFetcher
from watchdog.scrape.http1 import PageClient

pytestmark = pytest.mark.timeout(120)

PAGES = sorted((Path(__file__).resolve().parents[1] / "data" / "metrics").glob("*.txt"))
PROM = "text/plain; version=0.0.4; charset=utf-8"
LIMITS = HttpLimits(connect_timeout=2.0, read_timeout=10.0, deadline=30.0, max_bytes=16 * 1024 * 1024)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        srv = self.server
        with srv.lock:
            srv.connections.add(self.client_address)
            srv.requests += 1
        body, mode = srv.body, srv.mode
        self.send_response(200)
        self.send_header("Content-Type", PROM)
        if mode == "length":
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif mode.startswith("chunked"):
            size = int(mode.split(":")[1])
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), size):
                part = body[i:i + size]
                ext = b";name=value" if i == 0 else b""
                self.wfile.write(b"%X%s\r\n%s\r\n" % (len(part), ext, part))
                self.wfile.flush()
            self.wfile.write(b"0\r\nX-Trailer: yes\r\n\r\n")
        else:  # "close": no framing, the body ends when the connection does
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
        if srv.close_after:
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.body = b""
        self.mode = "length"
        self.close_after = False
        self.requests = 0
        self.connections: set[tuple[str, int]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


MODES = ["length", "chunked:8192", "chunked:1", "chunked:1000", "close"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_same_bytes_as_requests(server: Server, page: Path, mode: str) -> None:
    body = page.read_bytes()
    if mode == "chunked:1":
        body = body[:3000]  # one byte a chunk: keep it short
    server.body, server.mode = body, mode
    expected = requests.get(server.url + "/metrics", timeout=10)
    client = PageClient(server.url, LIMITS)
    try:
        for _ in range(2):  # the second over the kept-alive connection, or a fresh one after "close"
            got = client.get("/metrics", accept="text/plain")
            assert got.status == expected.status_code == 200
            assert got.content_type == expected.headers["Content-Type"]
            assert got.body == expected.content == body
    finally:
        client.close()


def test_keep_alive_reuses_one_connection(server: Server) -> None:
    server.body = PAGES[0].read_bytes()
    client = PageClient(server.url, LIMITS)
    try:
        for _ in range(5):
            assert client.get("/metrics").body == server.body
    finally:
        client.close()
    assert server.requests == 5
    assert len(server.connections) == 1


def test_a_connection_the_server_closed_is_replaced(server: Server) -> None:
    server.body, server.close_after = PAGES[0].read_bytes(), True  # HTTP/1.1 framing, then the server hangs up
    client = PageClient(server.url, LIMITS)
    try:
        for _ in range(3):
            assert client.get("/metrics").body == server.body
    finally:
        client.close()
    assert len(server.connections) == 3


def test_the_fetcher_reads_through_it_and_closes_with_the_session(server: Server) -> None:
    server.body = PAGES[0].read_bytes()
    http = EngineHTTP(server.url, LIMITS)
    fetcher = MetricsFetcher(http)
    first, second = fetcher.scrape(), fetcher.scrape()
    assert first.ok and second.ok and first.size == second.size == len(server.body)
    assert len(server.connections) == 1  # the scrape's own kept-alive socket, not requests' pool
    assert fetcher._page is not None and fetcher._page._sock is not None
    http.close()
    assert fetcher._page._sock is None  # closed with the session


def test_https_goes_through_requests() -> None:
    assert MetricsFetcher("https://vllm.internal/metrics")._page is None
    with pytest.raises(ValueError, match="plain http only"):
        PageClient("https://vllm.internal", LIMITS)


def test_auth_header_is_sent(server: Server) -> None:
    seen: list[str | None] = []
    original = Handler.do_GET

    def record(h: Handler) -> None:
        seen.append(h.headers.get("Authorization"))
        original(h)

    server.body = b"x 1\n"
    Handler.do_GET = record  # type: ignore[method-assign,assignment]
    try:
        http = EngineHTTP(server.url, LIMITS, api_key="sekrit")
        assert MetricsFetcher(http).scrape().status == 200
        http.close()
    finally:
        Handler.do_GET = original  # type: ignore[method-assign]
    assert seen and set(seen) == {"Bearer sekrit"}  # the filtered GET, then the whole page (this one has no engine)


class Scripted:
    """One kept-alive connection answered from a script, one raw answer per request (the bytes as given)."""

    def __init__(self, answers: list[bytes | tuple[bytes, ...] | None]) -> None:
        # None: read the request, answer nothing (until the test ends); a tuple: its parts sent 50 ms apart
        self.answers = answers
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.done = threading.Event()
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.answers and not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                while self.answers:
                    if not conn.recv(65536):
                        break
                    answer = self.answers.pop(0)
                    if answer is None:
                        self.done.wait(30)
                        return
                    for i, part in enumerate(answer if isinstance(answer, tuple) else (answer,)):
                        if i:
                            time.sleep(0.05)
                        conn.sendall(part)

    def close(self) -> None:
        self.done.set()
        self.sock.close()
        self.thread.join(10)


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_kept_alive_answers_of_every_shape_in_a_row() -> None:
    """After the first GET the client takes a short path for a 200 whose head comes whole; every other answer on
    the kept-alive connection (chunked, a redirect, an early hint) goes on through the general reader."""
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    redirect = b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
    hint = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + ok(b"after the hint")
    srv = Scripted([ok(b"first"), ok(b"second"), chunked, redirect, ok(b"moved"), hint, ok(b"x" * 200_000)])
    client = PageClient(srv.url, LIMITS)
    try:
        assert [client.get("/metrics").body for _ in range(6)] == [
            b"first", b"second", b"abcde", b"moved", b"after the hint", b"x" * 200_000]
        assert srv.accepted == 1
    finally:
        client.close()
        srv.close()


def test_no_answer_on_the_kept_alive_connection_is_no_answer_once() -> None:
    srv = Scripted([ok(b"first"), None])
    client = PageClient(srv.url, HttpLimits(connect_timeout=1.0, read_timeout=1.0, deadline=5.0))
    try:
        assert client.get("/metrics").body == b"first"
        started = time.monotonic()
        with pytest.raises(HttpFailure) as err:
            client.get("/metrics")
        assert err.value.kind == "no_answer" and "sent no response within 1s" in err.value.message
        assert time.monotonic() - started < 1.9, "the read timeout was waited out twice (a fresh connection tried)"
    finally:
        client.close()
        srv.close()


def test_a_head_seen_before_is_known_and_every_chunked_shape_still_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scrape's answer (200, chunked, kept alive) comes with the same head each time but its Date: the head read
    once is known after that, and a body of one chunk is taken in one step. Bodies of other shapes (several chunks,
    an extension, a trailer, a body sent after the head) and another head still read as the general reader reads
    them."""
    def answer(second: int, body: bytes, more: bytes = b"") -> bytes:
        return (b"HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 01:00:%02d GMT\r\nContent-Type: text/plain\r\n%s"
                b"Transfer-Encoding: chunked\r\n\r\n%s" % (second, more, body))

    split = answer(5, b"")
    srv = Scripted([
        answer(1, b"5\r\nfirst\r\n0\r\n\r\n"),
        answer(2, b"6\r\nsecond\r\n0\r\n\r\n"),
        answer(3, b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
        answer(4, b"3;x=y\r\nabc\r\n0\r\n\r\n"),
        (split, b"b\r\nafter a gap\r\n0\r\n\r\n"),
        (split, b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"),
        answer(7, b"4\r\nlast\r\n0\r\n\r\n", b"Connection: close\r\n"),
    ])
    parsed: list[bytes] = []
    parse = PageClient._parse_head

    def counted(raw: bytes, url: str) -> object:
        parsed.append(raw)
        return parse(raw, url)

    monkeypatch.setattr(PageClient, "_parse_head", staticmethod(counted))
    client = PageClient(srv.url, LIMITS)
    try:
        bodies = [client.get("/metrics") for _ in range(7)]
        assert [b.body for b in bodies] == [b"first", b"second", b"abcde", b"abc", b"after a gap", b"abc", b"last"]
        assert {b.content_type for b in bodies} == {"text/plain"}
        assert srv.accepted == 1
        assert len(parsed) == 2, "the head (but its date) read once, then known; the one with Connection: close is new"
        assert client._sock is None, "Connection: close was honoured: the known head did not stand in for it"
    finally:
        client.close()
        srv.close()


def test_a_chunked_body_cut_after_the_head_is_truncated_once_known() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    srv = Scripted([head + b"2\r\nok\r\n0\r\n\r\n", head])
    client = PageClient(srv.url, LIMITS)
    try:
        assert client.get("/metrics").body == b"ok"
        srv.done.set()  # the second answer is the head alone, then the connection closes
        with pytest.raises(HttpFailure) as err:
            client.get("/metrics")
        assert err.value.kind == "truncated" and "IncompleteRead(0 bytes read)" in err.value.message
    finally:
        client.close()
        srv.close()
