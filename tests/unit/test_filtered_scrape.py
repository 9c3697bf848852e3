"""The scrape asks for only the samples it reads (``/metrics/?name[]=...``) and falls back to the whole page.

The filtering server here is prometheus_client's own WSGI app over a registry that holds a real recorded vLLM page
(its families re-exposed by a collector), mounted the way vLLM 0.32 mounts it: ``/metrics`` answered by a route that
ignores the query, ``/metrics/`` by prometheus_client. The reading of the filtered page must equal ``read_page`` of
the whole page, for every real page we own. Other servers: one that ignores the filter, one that answers 404 on
``/metrics/``, one whose filtered page lacks an engine, one that is down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from watchdog.core.types import HttpLimits
from watchdog.scrape.fetch import FILTERED, RECHECK, WHOLE, MetricsFetcher
from watchdog.scrape.page import WANTED_SAMPLES, read_page

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
PAGES = sorted(DATA.glob("*.txt"))
LIMITS = HttpLimits(connect_timeout=2.0, read_timeout=5.0, deadline=10.0)
PROM = "text/plain; version=0.0.4; charset=utf-8"

App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class RecordedPage:
    """A collector that exposes the families of a recorded page, as the engine's registry would."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def vllm_like(text: str) -> App:
    """``/metrics``: the whole page whatever the query (vLLM 0.32's instrumentator route); ``/metrics/``:
    prometheus_client's app, which honours ``name[]``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RecordedPage(text))  # type: ignore[arg-type]
    filtering = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/metrics/":
            return filtering(environ, start)  # type: ignore[no-any-return]
        return whole(text)(environ, start)
    return app


def whole(text: str, filtered_404: bool = False) -> App:
    """Every path answers the whole page (a server without the filter); ``filtered_404``: ``/metrics/`` is 404."""
    def app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if filtered_404 and environ["PATH_INFO"] == "/metrics/":
            start("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found"]
        start("200 OK", [("Content-Type", PROM)])
        return [text.encode()]
    return app


def without_engine_1(text: str) -> App:
    """The filtered page lacks engine 1's samples (a filter that loses series): the whole page has them."""
    def app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/metrics/":
            names = set(parse_qs(environ["QUERY_STRING"])["name[]"])
            kept = [ln for ln in text.splitlines()
                    if ln.split("{")[0].split(" ")[0] in names and 'engine="1"' not in ln]
            start("200 OK", [("Content-Type", PROM)])
            return [("\n".join(kept) + "\n").encode()]
        return whole(text)(environ, start)
    return app


class Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class Served:
    """A WSGI app on a loopback port, in a thread, with the paths it was asked for."""

    def __init__(self, app: App) -> None:
        self.paths: list[str] = []

        def recording(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
            query = environ.get("QUERY_STRING", "")
            self.paths.append(environ["PATH_INFO"] + ("?" + query if query else ""))
            return app(environ, start)

        self.server: WSGIServer = make_server("127.0.0.1", 0, recording, handler_class=Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def serve() -> Iterator[Callable[[App], Served]]:
    started: list[Served] = []

    def start(app: App) -> Served:
        started.append(Served(app))
        return started[-1]

    yield start
    for s in started:
        s.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_filter_asks_for_every_sample_read_and_only_those() -> None:
    assert FILTERED.startswith("/metrics/?")
    assert sorted(parse_qs(FILTERED.split("?", 1)[1])["name[]"]) == sorted(WANTED_SAMPLES)


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_the_filtered_page_reads_as_the_whole_page(serve: Callable[[App], Served], path: Path) -> None:
    text = path.read_text()
    server = serve(vllm_like(text))
    clock = Clock()
    fetcher = MetricsFetcher(server.url, LIMITS, clock=clock)
    first = fetcher.scrape()
    assert first.page == read_page(text)
    assert server.paths == [FILTERED, WHOLE]  # the filter, checked once against the whole page
    assert first.size < len(text.encode()) / 5, "the filtered page should be a fraction of the whole one"
    clock.now += RECHECK - 1
    assert fetcher.scrape().page == read_page(text)
    assert server.paths[2:] == [FILTERED]  # checked: the filtered page alone
    clock.now += 2
    fetcher.scrape()
    assert server.paths[3:] == [FILTERED, WHOLE]  # checked again after RECHECK


def test_a_server_that_ignores_the_filter_is_read_whole(serve: Callable[[App], Served]) -> None:
    text = PAGES[0].read_text()
    server = serve(whole(text))
    clock = Clock()
    fetcher = MetricsFetcher(server.url, LIMITS, clock=clock)
    assert fetcher.scrape().page == read_page(text)
    assert server.paths == [FILTERED, WHOLE]
    assert not fetcher.filtering
    for _ in range(3):
        assert fetcher.scrape().page == read_page(text)
    assert server.paths[2:] == [WHOLE] * 3
    clock.now += RECHECK
    assert fetcher.filtering  # tried again: the engine may have been replaced by one that filters


def test_a_filtered_path_answered_404_costs_nothing_and_is_not_an_error(serve: Callable[[App], Served]) -> None:
    text = PAGES[0].read_text()
    server = serve(whole(text, filtered_404=True))
    fetcher = MetricsFetcher(server.url, LIMITS, clock=Clock())
    got = fetcher.scrape()
    assert got.ok and got.error_kind is None and got.page == read_page(text)
    assert server.paths == [FILTERED, WHOLE]
    fetcher.scrape()
    assert server.paths[2:] == [WHOLE]


def test_a_filtered_page_that_loses_a_series_is_not_used(serve: Callable[[App], Served]) -> None:
    dp2 = next(p for p in PAGES if "dp2" in p.name).read_text()
    server = serve(without_engine_1(dp2))
    fetcher = MetricsFetcher(server.url, LIMITS, clock=Clock())
    got = fetcher.scrape()
    assert got.page is not None and set(got.page.engines) == {"0", "1"}
    assert got.page == read_page(dp2)
    assert not fetcher.filtering
    fetcher.scrape()
    assert server.paths == [FILTERED, WHOLE, WHOLE]


def test_a_server_that_is_down_is_asked_once(serve: Callable[[App], Served]) -> None:
    server = serve(whole(""))
    url = server.url
    server.close()
    got = MetricsFetcher(url, LIMITS, clock=Clock()).scrape()
    assert got.error_kind == "refused"
    assert server.paths == []


def test_when_both_pages_fail_the_whole_page_failure_is_reported(serve: Callable[[App], Served]) -> None:
    def broken(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        start("503 Service Unavailable", [("Content-Type", "text/plain")])
        return [b"busy"]
    server = serve(broken)
    fetcher = MetricsFetcher(server.url, LIMITS, clock=Clock())
    got = fetcher.scrape()
    assert got.error_kind == "http_5xx" and got.status == 503
    assert server.paths == [FILTERED, WHOLE]
    assert fetcher.filtering  # neither page could be read: nothing learned about the filter
