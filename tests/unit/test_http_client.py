"""The scrape's hand-written HTTP/1.1 client (watchdog/scrape/http1.py) agrees with requests.

Real pages are served by a real HTTP server on loopback, with Content-Length, chunked (in small and odd-sized
chunks, with a chunk extension and a trailer), and read-to-close framing; the client must return the same status,
content type and bytes as a plain requests GET of the same URL. Keep-alive: consecutive GETs reuse one connection,
and a connection the server closed meanwhile is replaced without a failure. The error cases are in
test_scrape_bad_input.py, which runs through this client (MetricsFetcher uses it for http URLs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from watchdog.scrape.engine_http import EngineHTTP
from watchdog.scrape.fetch import MetricsFetcher
from watchdog.scrape.http1 import PageClient
from watchdog.types import HttpLimits

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
