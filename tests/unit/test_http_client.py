"""The scrape's GET (`EngineHTTP.get_page`, urllib3 on one kept-alive connection) against real servers on loopback.

Real pages are served with Content-Length, chunked (in small and odd-sized chunks, with a chunk extension and a
trailer), and read-to-close framing; the scrape must return the same status, content type and bytes as a plain
requests GET of the same URL. Keep-alive: consecutive GETs reuse one connection, a connection the server closed
meanwhile is replaced without a failure, and closing the session closes it. The error cases are in
test_scrape_bad_input.py (MetricsFetcher reads through this GET).
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

    def finish(self) -> None:
        super().finish()
        with self.server.lock:
            self.server.closed.add(self.client_address)


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
        self.closed: set[tuple[str, int]] = set()  # connections whose client hung up (or the server did)

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
    http = EngineHTTP(server.url, LIMITS)
    try:
        for _ in range(2):  # the second over the kept-alive connection, or a fresh one after "close"
            got = http.get_page("/metrics", accept="text/plain")
            assert got.status == expected.status_code == 200
            assert got.content_type == expected.headers["Content-Type"]
            assert got.body == expected.content == body
    finally:
        http.close()


def test_keep_alive_reuses_one_connection(server: Server) -> None:
    server.body = PAGES[0].read_bytes()
    http = EngineHTTP(server.url, LIMITS)
    try:
        for _ in range(5):
            assert http.get_page("/metrics").body == server.body
    finally:
        http.close()
    assert server.requests == 5
    assert len(server.connections) == 1


def test_a_connection_the_server_closed_is_replaced(server: Server) -> None:
    server.body, server.close_after = PAGES[0].read_bytes(), True  # HTTP/1.1 framing, then the server hangs up
    http = EngineHTTP(server.url, LIMITS)
    try:
        for _ in range(3):
            assert http.get_page("/metrics").body == server.body
    finally:
        http.close()
    assert len(server.connections) == 3


def _wait_closed(server: Server, n: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with server.lock:
            if len(server.closed) >= n:
                return True
        time.sleep(0.02)
    return False


def test_the_fetcher_reads_through_one_connection_closed_with_the_session(server: Server) -> None:
    server.body = PAGES[0].read_bytes()
    http = EngineHTTP(server.url, LIMITS)
    fetcher = MetricsFetcher(http)
    first, second, third = fetcher.scrape(), fetcher.scrape(), fetcher.scrape()
    assert first.ok and second.ok and third.ok and first.size == third.size == len(server.body)
    # the filtered GET and the whole page's (this server does not filter), then the filtered GET twice: one socket
    assert server.requests == 4 and len(server.connections) == 1
    assert not server.closed, "the kept-alive connection was closed between scrapes"
    http.close()
    assert _wait_closed(server, 1), "closing the session left the scrape's connection open"


def test_a_failed_read_drops_the_connection_and_the_next_scrape_opens_another(server: Server) -> None:
    server.body = b"x" * (8 * 1024 * 1024)  # more than the socket buffers hold: not all of it read by the cap
    http = EngineHTTP(server.url, HttpLimits(connect_timeout=2.0, read_timeout=10.0, deadline=30.0, max_bytes=100_000))
    try:
        for _ in range(2):
            with pytest.raises(HttpFailure) as err:
                http.get_page("/metrics")
            assert err.value.kind == "too_big" and err.value.status == 200
        assert _wait_closed(server, 2), "a body over the cap was not dropped with its connection"
        assert len(server.connections) == 2
    finally:
        http.close()


def test_https_to_a_plain_http_port_is_unreachable(server: Server) -> None:
    http = EngineHTTP(server.url.replace("http://", "https://"), LIMITS)
    try:
        with pytest.raises(HttpFailure) as err:
            http.get_page("/metrics")
        assert err.value.kind == "unreachable" and "/metrics" in err.value.message
    finally:
        http.close()


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
        # None: read the request, answer nothing (until the test ends); b"": read the request and close the
        # connection without an answer (the next is answered on a new one); a tuple: its parts sent 50 ms apart
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
                    if not _read_request(conn):
                        break
                    answer = self.answers.pop(0)
                    if answer is None:
                        self.done.wait(30)
                        return
                    if answer == b"":
                        break
                    for i, part in enumerate(answer if isinstance(answer, tuple) else (answer,)):
                        if i:
                            time.sleep(0.05)
                        conn.sendall(part)

    def close(self) -> None:
        self.done.set()
        self.sock.close()
        self.thread.join(10)


def _read_request(conn: socket.socket) -> bool:
    """One request's head and its Content-Length of body; False when the client closed the connection first."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (got := conn.recv(65536)):
            return False
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        if not (got := conn.recv(65536)):
            return False
        body += got
    return True


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_kept_alive_answers_of_every_shape_in_a_row() -> None:
    """Answers of every shape on the one kept-alive connection: by length, chunked, a redirect followed on it, a
    100 Continue before the answer, a large body."""
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    redirect = b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
    hint = b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after the 100")
    srv = Scripted([ok(b"first"), ok(b"second"), chunked, redirect, ok(b"moved"), hint, ok(b"x" * 200_000)])
    http = EngineHTTP(srv.url, LIMITS)
    try:
        assert [http.get_page("/metrics").body for _ in range(6)] == [
            b"first", b"second", b"abcde", b"moved", b"after the 100", b"x" * 200_000]
        assert srv.accepted == 1
    finally:
        http.close()
        srv.close()


def test_a_kept_alive_connection_closed_as_the_request_goes_is_tried_once_more_on_a_fresh_one() -> None:
    srv = Scripted([ok(b"first"), b"", ok(b"second")])
    http = EngineHTTP(srv.url, LIMITS)
    try:
        assert http.get_page("/metrics").body == b"first"
        assert http.get_page("/metrics").body == b"second"
        assert srv.accepted == 2
    finally:
        http.close()
        srv.close()


def test_a_connection_closed_without_an_answer_twice_is_lost() -> None:
    srv = Scripted([b"", b""])
    http = EngineHTTP(srv.url, LIMITS)
    try:
        with pytest.raises(HttpFailure) as err:
            http.get_page("/metrics")
        assert err.value.kind == "lost" and "closed" in err.value.message and "without an answer" in err.value.message
        assert srv.accepted == 2
    finally:
        http.close()
        srv.close()


def test_no_answer_on_the_kept_alive_connection_is_no_answer_once() -> None:
    srv = Scripted([ok(b"first"), None])
    http = EngineHTTP(srv.url, HttpLimits(connect_timeout=1.0, read_timeout=1.0, deadline=5.0))
    try:
        assert http.get_page("/metrics").body == b"first"
        started = time.monotonic()
        with pytest.raises(HttpFailure) as err:
            http.get_page("/metrics")
        assert err.value.kind == "no_answer" and "sent no response within 1s" in err.value.message
        assert time.monotonic() - started < 1.9, "the read timeout was waited out twice (a fresh connection tried)"
    finally:
        http.close()
        srv.close()


def test_a_chunked_body_cut_after_the_head_on_the_kept_alive_connection_is_truncated() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    srv = Scripted([head + b"2\r\nok\r\n0\r\n\r\n", head])
    http = EngineHTTP(srv.url, LIMITS)
    try:
        assert http.get_page("/metrics").body == b"ok"
        srv.done.set()  # the second answer is the head alone, then the connection closes
        with pytest.raises(HttpFailure) as err:
            http.get_page("/metrics")
        assert err.value.kind == "truncated" and "IncompleteRead(0 bytes read)" in err.value.message
    finally:
        http.close()
        srv.close()


def test_every_request_goes_over_the_one_kept_alive_pool() -> None:
    """The probe's POST, the version and model reads and the scrape share the pool: one connection for all."""
    answer = b'{"version": "0.32.0"}'
    json_ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(answer), answer)
    srv = Scripted([json_ok, ok(b"page"), json_ok])
    http = EngineHTTP(srv.url, LIMITS)
    try:
        assert http.post_json("/v1/completions", {"prompt": "x"}, read_timeout=3.0).json() == {"version": "0.32.0"}
        assert http.get_page("/metrics").body == b"page"
        reply = http.get("/version", accept="application/json", read_timeout=3.0, max_bytes=1024)
        assert reply.status == 200 and reply.content_type == "application/json"
        assert srv.accepted == 1
    finally:
        http.close()
        srv.close()


def test_the_request_caps_and_failures_are_the_scrapes() -> None:
    """``max_bytes`` and ``read_timeout`` of one request; a refused connection; too many redirects."""
    loop = b"HTTP/1.1 302 Found\r\nLocation: /v1/models\r\nContent-Length: 0\r\n\r\n"
    srv = Scripted([ok(b"x" * 5000), loop, loop, loop, loop, ok(b"late"), None])
    http = EngineHTTP(srv.url, HttpLimits(connect_timeout=1.0, read_timeout=5.0, deadline=5.0, max_redirects=3))
    try:
        with pytest.raises(HttpFailure) as err:
            http.get("/version", max_bytes=1000)
        assert err.value.kind == "too_big" and err.value.status == 200 and "/version" in err.value.message
        with pytest.raises(HttpFailure) as err:
            http.get("/v1/models")
        assert err.value.kind == "redirects" and "redirects more than 3 times" in err.value.message
        assert http.get("/v1/models").body == b"late"  # the redirects' connection is reused
        started = time.monotonic()
        with pytest.raises(HttpFailure) as err:
            http.post_json("/v1/completions", {}, read_timeout=0.5)
        assert err.value.kind == "no_answer" and "sent no response within 0.5s" in err.value.message
        assert time.monotonic() - started < 4.0, "the request's own read timeout was not the one waited"
    finally:
        http.close()
        srv.close()
    nobody = EngineHTTP(srv.url, LIMITS)  # the port is closed now
    with pytest.raises(HttpFailure) as err:
        nobody.post_json("/v1/completions", {})
    assert err.value.kind == "refused" and err.value.message == f"nothing listening at {srv.url}/v1/completions " \
        "(connection refused)"
    nobody.close()
