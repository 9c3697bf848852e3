"""The scrape asks for only the samples it reads (``/metrics?name[]=...``, prometheus_client's filter, which vLLM's
exporter is). The reference is prometheus_client itself: every real page we own is loaded into a real
``CollectorRegistry``; the library's restricted output must read exactly as the whole page does, and a real
prometheus_client WSGI server must answer the fetcher's query with that restricted page. A server that refuses the
query, or a filtered page with nothing to read, falls back to the whole page."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from watchdog.scrape.fetch import FILTERED, WHOLE, MetricsFetcher
from watchdog.scrape.page import WANTED_NAMES, read_page

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
PAGES = sorted(DATA.glob("*.txt"))


class PageCollector(Collector):
    """A recorded page's families as one collector that describes them, as vLLM's own metrics do: the registry
    finds the collector by the sample names asked for, and keeps only those samples."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))

    def collect(self) -> Iterator[Any]:
        yield from self.families

    def describe(self) -> Iterator[Any]:
        yield from self.families


def registry_of(page: Path) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(PageCollector(page.read_text()))
    return reg


def test_real_pages_are_there() -> None:
    assert len(PAGES) >= 4, PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_the_filtered_page_reads_as_the_whole_page(page: Path) -> None:
    reg = registry_of(page)
    whole = generate_latest(reg).decode()
    filtered = generate_latest(reg.restricted_registry(WANTED_NAMES)).decode()
    assert read_page(whole).engines == read_page(page.read_text()).engines  # the library's round trip keeps it
    assert read_page(filtered).engines == read_page(whole).engines
    assert read_page(filtered).engines, "the page holds a reading"
    assert len(filtered) * 5 < len(whole), (len(filtered), len(whole))


def test_a_name_the_reader_wants_is_asked_for() -> None:
    """Removing any one name from the query loses a part of some real page's reading: none is asked for idly, and
    the reading depends on the query (so a name added to the reader but not to the query fails above)."""
    lost = set()
    for page in PAGES:
        reg = registry_of(page)
        full = read_page(generate_latest(reg).decode()).engines
        for name in WANTED_NAMES:
            part = read_page(generate_latest(reg.restricted_registry(set(WANTED_NAMES) - {name})).decode()).engines
            if part != full:
                lost.add(name)
    assert {"vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting"} <= lost


class QuietWSGI(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def prom_server() -> Iterator[tuple[str, list[str], CollectorRegistry]]:
    reg = registry_of(DATA / "vllm-0.32.0-tp2-under-load.txt")
    paths: ClassVar[list[str]] = []
    app = make_wsgi_app(reg)

    def recording(environ: dict[str, Any], start: Any) -> Any:
        paths.append(environ["PATH_INFO"] + "?" + environ.get("QUERY_STRING", ""))
        return app(environ, start)

    srv: WSGIServer = make_server("127.0.0.1", 0, recording, handler_class=QuietWSGI)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", paths, reg
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


def test_a_real_prometheus_client_server_answers_the_query(prom_server: tuple[str, list[str],
                                                                              CollectorRegistry]) -> None:
    url, paths, reg = prom_server
    f = MetricsFetcher(url)
    try:
        s = f.scrape()
    finally:
        f.http.close()
    assert s.page is not None and s.error_kind is None, s
    assert s.page.engines == read_page(generate_latest(reg).decode()).engines
    assert len(paths) == 1 and paths[0].startswith("/metrics?name%5B%5D=vllm%3A"), paths
    assert s.size * 5 < len(generate_latest(reg)), s.size


class Refusing(BaseHTTPRequestHandler):
    """Answers 400 to a query string (a proxy that allows only the bare path); the whole page otherwise."""

    paths: ClassVar[list[str]] = []
    page = (DATA / "vllm-0.32.0-tp2-idle.txt").read_bytes()
    refuse = True

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.paths.append(self.path)
        body = b"query strings are not allowed" if self.refuse and "?" in self.path else self.page
        self.send_response(400 if self.refuse and "?" in self.path else 200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, threading.Thread]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    return srv, t


def test_a_server_refusing_the_query_gets_the_whole_page_from_then_on() -> None:
    Refusing.paths = []
    srv, t = serve(Refusing)
    f = MetricsFetcher(f"http://127.0.0.1:{srv.server_address[1]}")
    try:
        first, second = f.scrape(), f.scrape()
    finally:
        f.http.close()
        srv.shutdown()
        srv.server_close()
        t.join(10)
    assert first.page is not None and second.page is not None
    assert first.page.engines == read_page(Refusing.page.decode()).engines
    assert Refusing.paths == [FILTERED, WHOLE, WHOLE]


class Renamed(Refusing):
    """Honours the filter, but its vLLM renamed every series the reader knows: the filtered page is empty."""

    page = b'# TYPE vllm:num_requests_active gauge\nvllm:num_requests_active{engine="0"} 3.0\n'
    refuse = False

    def do_GET(self) -> None:
        self.paths.append(self.path)
        body = b"" if "?" in self.path else self.page
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_an_empty_filtered_page_is_read_whole_so_the_verdict_can_say_what_it_holds() -> None:
    Renamed.paths = []
    srv, t = serve(Renamed)
    f = MetricsFetcher(f"http://127.0.0.1:{srv.server_address[1]}")
    try:
        s, again = f.scrape(), f.scrape()
    finally:
        f.http.close()
        srv.shutdown()
        srv.server_close()
        t.join(10)
    assert s.page is not None and s.page.vllm_series == 1 and not s.page.engines
    assert Renamed.paths == [FILTERED, WHOLE, FILTERED, WHOLE]  # the filter is kept: the server honours it
    assert again.page is not None and again.page.vllm_series == 1


def test_a_failure_names_the_page_not_the_query() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    f = MetricsFetcher(f"http://127.0.0.1:{port}")
    try:
        r = f.scrape()
    finally:
        f.http.close()
    assert r.error_kind == "refused", r
    assert r.error == f"nothing listening at http://127.0.0.1:{port}/metrics (connection refused)", r.error
