"""Every way a /metrics page can go wrong, served by a real HTTP server on loopback.

Each case checks the Scrape the fetcher makes of it (error kind, or what the reading holds) and the state the
judge reaches from it, with a message that names the problem. The server runs in a thread of this process on an
ephemeral port and is shut down after each test; a handler that must hang waits on an event set at teardown.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from watchdog.core.types import HttpLimits, Scrape, State, Verdict, base_url
from watchdog.judge.judge import SERVER, Judge
from watchdog.scrape.fetch import FILTERED, MetricsFetcher

pytestmark = pytest.mark.timeout(120)

REAL_PAGE = Path(__file__).resolve().parents[1] / "data" / "metrics" / "vllm-0.32.0-tp2-after-load.txt"
PROM = "text/plain; version=0.0.4; charset=utf-8"
MB = 1024 * 1024


def page(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


GOOD = page(
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0',
    'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0',
    'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0',
)

# -- a real server ---------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    server: LocalServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.requests += 1
        try:
            self.server.behaviour(self)
        finally:
            self.server.handled.set()

    # helpers for behaviours
    def reply(self, status: int, body: bytes = b"", content_type: str | None = PROM,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def count_sent(self, n: int) -> None:
        with self.server.lock:
            self.server.sent += n


Behaviour = Callable[[Handler], None]


class LocalServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.behaviour: Behaviour = lambda h: h.reply(200, GOOD)
        self.lock = threading.Lock()
        self.stop = threading.Event()  # set at teardown: hanging handlers return
        self.handled = threading.Event()  # a handler has returned
        self.requests = 0
        self.sent = 0  # body bytes a streaming behaviour got into the socket

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server() -> Iterator[LocalServer]:
    srv = LocalServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.stop.set()
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def fetch(url: str, *, read_timeout: float = 5.0, deadline: float = 10.0, max_bytes: int = 16 * MB) -> Scrape:
    limits = HttpLimits(connect_timeout=2.0, read_timeout=read_timeout, deadline=deadline, max_bytes=max_bytes)
    return MetricsFetcher(url, limits).scrape()


def judged(*scrapes: Scrape) -> list[Verdict]:
    judge = Judge()
    for s in scrapes:
        judge.observe(s)
    return judge.verdicts()


def only(verdicts: list[Verdict]) -> Verdict:
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def assert_failed(s: Scrape, kind: str, *words: str) -> None:
    assert not s.ok and s.page is None
    assert s.error_kind == kind, f"expected {kind}, got {s.error_kind}: {s.error}"
    for w in words:
        assert w in s.error, f"{w!r} not in {s.error!r}"


def assert_server_state(s: Scrape, state: State, *words: str) -> Verdict:
    v = only(judged(s))
    assert (v.engine, v.state) == (SERVER, state), v
    for w in words:
        assert w in v.reason, f"{w!r} not in {v.reason!r}"
    return v


# -- the baseline: a good page is read ---------------------------------------------------------------


def test_good_page_is_read_and_judged(server: LocalServer) -> None:
    s = fetch(server.url + "/metrics")
    assert s.ok and s.error_kind is None and s.status == 200 and s.size == len(GOOD)
    assert s.page is not None and list(s.page.engines) == ["0"]
    v = only(judged(s))
    assert (v.engine, v.state) == ("0", State.STARTING)  # answering; no generation seen advancing yet


# -- truncation --------------------------------------------------------------------------------------


def test_body_cut_mid_line(server: LocalServer) -> None:
    cut = GOOD[: GOOD.index(b"10.0")]  # ends inside the generation_tokens line; Content-Length matches
    server.behaviour = lambda h: h.reply(200, cut)
    s = fetch(server.url)
    assert_failed(s, "truncated", "mid-line", f"{len(cut)} characters")
    assert_server_state(s, State.BLIND, "truncated")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_connection_closed_before_the_body_is_complete(server: LocalServer, framing: str) -> None:
    # Cut at a line boundary, so the text alone looks whole: only the HTTP framing shows the loss.
    cut = GOOD[: GOOD.index(b"vllm:generation_tokens_total")]

    def short(h: Handler) -> None:
        if framing == "chunked":
            h.protocol_version = "HTTP/1.1"
            h.send_response(200)
            h.send_header("Content-Type", PROM)
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.write(b"%x\r\n%s\r\n" % (len(cut), cut))  # no terminating 0-chunk
        else:
            h.send_response(200)
            h.send_header("Content-Type", PROM)
            h.send_header("Content-Length", str(len(GOOD)))
            h.end_headers()
            h.wfile.write(cut)
        h.close_connection = True

    server.behaviour = short
    s = fetch(server.url)
    assert_failed(s, "truncated", "reading the page failed", "IncompleteRead")
    assert_server_state(s, State.BLIND, "truncated")


# -- values and series -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf"])
def test_non_finite_gauge_makes_the_engine_blind(server: LocalServer, bad: str) -> None:
    body = GOOD.replace(b'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
                        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {bad}'.encode())
    assert body != GOOD
    server.behaviour = lambda h: h.reply(200, body)
    s = fetch(server.url)
    assert s.ok and s.page is not None
    assert s.page.engines["0"].waiting is None
    assert len(s.page.dropped) == 1 and s.page.dropped[0].startswith("vllm:num_requests_waiting{")
    v = only(judged(s))
    assert (v.engine, v.state) == ("0", State.BLIND)
    assert "vllm:num_requests_waiting is missing or not a finite number" in v.reason


def test_non_finite_counters_leave_no_progress_evidence(server: LocalServer) -> None:
    body = (GOOD.replace(b"} 10.0", b"} NaN").replace(b"} 1.0", b"} +Inf"))
    server.behaviour = lambda h: h.reply(200, body)
    s = fetch(server.url)
    assert s.ok and s.page is not None
    assert s.page.engines["0"].counters == {}
    assert sorted(d.split("{")[0] for d in s.page.dropped) == ["vllm:generation_tokens_total",
                                                               "vllm:request_success_total"]
    v = only(judged(s))
    assert (v.engine, v.state) == ("0", State.BLIND)
    assert "no token or request counters" in v.reason


def test_one_non_finite_counter_keeps_the_others(server: LocalServer) -> None:
    body = GOOD.replace(b"} 10.0", b"} +Inf")
    server.behaviour = lambda h: h.reply(200, body)
    s = fetch(server.url)
    assert s.ok and s.page is not None
    assert s.page.engines["0"].counters == {"request_success": 1.0}
    assert only(judged(s)).state == State.STARTING


def test_duplicate_series(server: LocalServer) -> None:
    line = b'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0\n'
    server.behaviour = lambda h: h.reply(200, GOOD + line)
    s = fetch(server.url)
    assert_failed(s, "duplicate", "vllm:generation_tokens_total", "appears twice")
    assert_server_state(s, State.BLIND, "duplicate")


def test_a_page_naming_more_engines_than_any_server_runs_is_refused(server: LocalServer) -> None:
    """A hostile page with an engine label per line is refused as a whole, not read into 100,000 engines; as many
    engines as the cap allows are still read."""
    from watchdog.scrape.page import MAX_ENGINES

    def engines(n: int) -> bytes:
        return page(*(f'vllm:num_requests_running{{engine="{i}",model_name="m"}} 0.0' for i in range(n)))

    server.behaviour = lambda h: h.reply(200, engines(MAX_ENGINES))
    s = fetch(server.url)
    assert s.ok and s.page is not None and len(s.page.engines) == MAX_ENGINES
    server.behaviour = lambda h: h.reply(200, engines(100_000))
    s = fetch(server.url)
    assert_failed(s, "malformed", f"more than {MAX_ENGINES} engines")
    assert_server_state(s, State.BLIND, "malformed")


def test_one_engine_with_an_extra_label_per_line_is_refused(server: LocalServer) -> None:
    """The engine cap alone lets one engine through with 100,000 lines that differ in an extra label (seconds to read
    at the page cap): the samples read are capped too, with a clear reason; a page at the cap is still read."""
    from watchdog.scrape.page import MAX_SAMPLES

    def lines(n: int) -> bytes:
        return page(*(f'vllm:num_requests_running{{engine="0",model_name="m",x="{i}"}} 0.0' for i in range(n)))

    server.behaviour = lambda h: h.reply(200, lines(MAX_SAMPLES))
    s = fetch(server.url)
    assert s.ok and s.page is not None and list(s.page.engines) == ["0"]
    server.behaviour = lambda h: h.reply(200, lines(100_000))
    s = fetch(server.url)
    assert_failed(s, "malformed", f"more than {MAX_SAMPLES} samples")
    assert_server_state(s, State.BLIND, "malformed")


def test_page_without_vllm_series(server: LocalServer) -> None:
    body = page("# TYPE python_info gauge", 'python_info{version="3.11.7"} 1.0', "process_open_fds 38.0")
    server.behaviour = lambda h: h.reply(200, body)
    s = fetch(server.url)
    assert s.ok and s.page is not None and s.page.engines == {} and s.page.vllm_series == 0
    assert_server_state(s, State.BLIND, "no vllm: series", "not a vLLM server")


def test_vllm_page_without_engine_series(server: LocalServer) -> None:
    body = page(
        'vllm:cache_config_info{block_size="16",cache_dtype="auto"} 1.0',
        'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 0.0',
    )
    server.behaviour = lambda h: h.reply(200, body)
    s = fetch(server.url)
    assert s.ok and s.page is not None and s.page.engines == {} and s.page.vllm_series == 2
    assert_server_state(s, State.BLIND, "2 vllm: series", "--disable-log-stats")


def test_invalid_utf8(server: LocalServer) -> None:
    body = GOOD.replace(b'model_name="m"', b'model_name="\xff\xfe"', 1)
    server.behaviour = lambda h: h.reply(200, body)
    s = fetch(server.url)
    bad_at = body.index(b"\xff")
    assert_failed(s, "not_text", "not UTF-8", f"at byte {bad_at}")
    assert s.status == 200 and s.size == len(body)
    assert_server_state(s, State.BLIND, "not_text")


# -- size and time -----------------------------------------------------------------------------------


def _stream(total: int, chunk: bytes, *, pause: float = 0.0) -> Behaviour:
    """Declare ``total`` bytes and send ``chunk`` after ``chunk`` until done, the client goes, or teardown."""

    def behaviour(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", PROM)
        h.send_header("Content-Length", str(total))
        h.end_headers()
        h.wfile.flush()
        sent = 0
        try:
            while sent < total and not h.server.stop.is_set():
                h.wfile.write(chunk)
                h.wfile.flush()
                sent += len(chunk)
                h.count_sent(len(chunk))
                if pause:
                    h.server.stop.wait(pause)
        except OSError:
            pass  # the client hung up: what we wanted
        h.close_connection = True

    return behaviour


def test_fifty_megabyte_page_is_capped_and_not_read_to_the_end(server: LocalServer) -> None:
    total = 50 * MB
    server.behaviour = _stream(total, b"# padding line for an oversized page\n" * 1771)  # ~64 KB a write
    s = fetch(server.url, max_bytes=1 * MB)
    assert_failed(s, "too_big", "larger than the 1048576 byte cap", "stopped reading")
    assert server.handled.wait(30), "the server was still sending: the client did not drop the connection"
    assert server.sent < total // 2, f"server got {server.sent} bytes out: the client read on past the cap"
    assert_server_state(s, State.BLIND, "too_big")


def test_trickling_server_hits_the_deadline(server: LocalServer) -> None:
    total = 1000  # a byte every 0.2 s: 200 s to finish
    server.behaviour = _stream(total, b"#", pause=0.2)
    s = fetch(server.url, read_timeout=5.0, deadline=1.0)
    assert_failed(s, "trickle", "not complete after 1s", "too slowly")
    assert server.handled.wait(30), "the server was still trickling: the client did not drop the connection"
    assert server.sent < total
    assert_server_state(s, State.BLIND, "trickle")


# -- the server's answer -----------------------------------------------------------------------------


def test_connection_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = fetch(f"http://127.0.0.1:{port}")
    assert_failed(s, "refused", "nothing listening", f":{port}/metrics")
    assert s.status is None
    assert_server_state(s, State.DOWN, "connection refused")


def test_http_500_is_down(server: LocalServer) -> None:
    server.behaviour = lambda h: h.reply(500, b"Internal Server Error", "text/plain")
    s = fetch(server.url)
    assert_failed(s, "http_5xx", "HTTP 500")
    assert s.status == 500
    assert_server_state(s, State.DOWN, "HTTP 500")


def test_http_404_is_blind(server: LocalServer) -> None:
    server.behaviour = lambda h: h.reply(404, b'{"detail":"Not Found"}', "application/json")
    s = fetch(server.url)
    assert_failed(s, "http_status", "HTTP 404", "expected 200")
    assert s.status == 404
    assert_server_state(s, State.BLIND, "http_status", "HTTP 404")


HTML = b"<!DOCTYPE html>\n<html><head><title>Grafana</title></head><body>hello</body></html>\n"


def test_html_page_with_html_content_type(server: LocalServer) -> None:
    server.behaviour = lambda h: h.reply(200, HTML, "text/html; charset=utf-8")
    s = fetch(server.url)
    assert_failed(s, "html", "HTML page", "text/html", "not Prometheus text")
    assert_server_state(s, State.BLIND, "html")


@pytest.mark.parametrize("content_type", ["text/plain", None], ids=["text-plain", "no-content-type"])
def test_html_page_without_html_content_type(server: LocalServer, content_type: str | None) -> None:
    server.behaviour = lambda h: h.reply(200, b"  \n" + HTML, content_type)
    s = fetch(server.url)
    assert_failed(s, "html", "the page is HTML, not Prometheus text", "base URL")
    assert_server_state(s, State.BLIND, "html")


def test_redirect_loop(server: LocalServer) -> None:
    def loop(h: Handler) -> None:
        target = "/elsewhere" if h.path == "/metrics" else "/metrics"
        h.reply(302, b"", None, {"Location": target})

    server.behaviour = loop
    s = fetch(server.url)
    assert_failed(s, "redirects", "more than 3 times")
    # the filtered page's GET and then the whole page's (a redirect may be the filtered path's alone), each 1 + 3
    assert server.requests <= 8, f"followed {server.requests} requests with max_redirects=3"
    assert_server_state(s, State.BLIND, "redirects")


def _hang(h: Handler) -> None:
    h.server.stop.wait(60)  # accepted, request read, never a byte back


def test_server_that_never_answers_is_starting_when_it_never_answered(server: LocalServer) -> None:
    server.behaviour = _hang
    s = fetch(server.url, read_timeout=0.5)
    assert_failed(s, "no_answer", "accepted the connection but sent no response", "0.5s")
    assert_server_state(s, State.STARTING, "still loading?")


def test_server_that_stops_answering_after_answering_is_down(server: LocalServer) -> None:
    body = REAL_PAGE.read_bytes()
    server.behaviour = lambda h: h.reply(200, body)
    first = fetch(server.url)
    assert first.ok and first.page is not None and first.page.engines["0"].running == 4
    server.behaviour = _hang
    second = fetch(server.url, read_timeout=0.5)
    assert_failed(second, "no_answer", "sent no response")
    v = only(judged(first, second))
    assert (v.engine, v.state) == ("0", State.DOWN), v
    assert "stopped answering" in v.reason


def _page_hangs(health: int) -> Behaviour:
    def behaviour(h: Handler) -> None:
        if h.path.startswith("/metrics"):
            _hang(h)
        else:
            h.reply(health, b"", content_type=None)

    return behaviour


def test_a_page_that_hangs_while_health_answers_is_blind_not_down(server: LocalServer) -> None:
    """Seen in the storm: a /metrics held by its route (the instrumentator's, a proxy's), /health and the engine
    serving on, was called down and the serving engine restarted. The page's silence is asked about at /health."""
    body = REAL_PAGE.read_bytes()
    server.behaviour = lambda h: h.reply(200, body)
    first = fetch(server.url)
    server.behaviour = _page_hangs(200)
    second = fetch(server.url, read_timeout=0.5)
    assert_failed(second, "page_hangs", "sent no response", "/health answered 200", "its page is stuck")
    v = only(judged(first, second))
    assert (v.engine, v.state) == ("0", State.BLIND), v
    assert "page_hangs" in v.reason
    assert_server_state(second, State.BLIND, "page_hangs")  # never answered before: blind, not still loading


def test_a_page_that_hangs_while_health_fails_is_still_down(server: LocalServer) -> None:
    body = REAL_PAGE.read_bytes()
    server.behaviour = lambda h: h.reply(200, body)
    first = fetch(server.url)
    server.behaviour = _page_hangs(503)
    second = fetch(server.url, read_timeout=0.5)
    assert_failed(second, "no_answer", "sent no response")
    assert "/health" not in second.error
    v = only(judged(first, second))
    assert (v.engine, v.state) == ("0", State.DOWN), v


def test_headers_then_silence_is_no_answer(server: LocalServer) -> None:
    def headers_only(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", PROM)
        h.send_header("Content-Length", str(len(GOOD)))
        h.end_headers()
        h.wfile.flush()
        h.server.stop.wait(60)

    server.behaviour = headers_only
    s = fetch(server.url, read_timeout=0.5)
    assert_failed(s, "no_answer", "reading the page failed after 0 bytes")
    assert_server_state(s, State.STARTING, "still loading?")


# -- base_url ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "base"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/metrics/", "http://127.0.0.1:8000"),
    ("  https://vllm.internal/v1/proxy/metrics \n", "https://vllm.internal/v1/proxy"),
    ("http://[::1]:8000/metrics", "http://[::1]:8000"),
])
def test_base_url_accepts_a_metrics_url(given: str, base: str) -> None:
    assert base_url(given) == base
    assert MetricsFetcher(given).url == base + "/metrics"


@pytest.mark.parametrize("bad", ["ftp://127.0.0.1:8000", "127.0.0.1:8000", "localhost:8000/metrics", "http://",
                                 "file:///metrics", ""])
def test_base_url_rejects_a_bad_scheme_or_host(bad: str) -> None:
    with pytest.raises(ValueError, match="not an http\\(s\\) URL") as err:
        base_url(bad)
    assert repr(bad) in str(err.value)


def test_fetcher_uses_the_base_url(server: LocalServer) -> None:
    paths: list[str] = []

    def record(h: Handler) -> None:
        paths.append(h.path)
        h.reply(200, GOOD)

    server.behaviour = record
    assert fetch(server.url + "/metrics/").ok
    assert paths == [FILTERED, "/metrics"]  # the filtered page, checked once against the whole one
