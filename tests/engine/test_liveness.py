"""Liveness verdicts against a real vLLM (CPU build, TP=2, multiprocessing executor).

Each test runs the real `watchdog run` command as a separate process and reads its events.jsonl.
Thresholds are set per test (shorter than the defaults where the point is the shape, not the number);
the default settings are measured in bench/bench_detection.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from tests.harness.faults import frozen, kill
from tests.harness.load import BackgroundRequest, LoadGenerator, calibrated_tokens, long_prompt
from tests.harness.metrics import sample_sums
from tests.harness.server import VllmServer
from tests.harness.watcher import WatchdogProcess, event_time
from watchdog.scrape.fetch import MetricsFetcher
from watchdog.scrape.page import read_page

pytestmark = pytest.mark.engine

Watch = Callable[..., WatchdogProcess]
# These tests prove the metric judgement alone; tests/engine/test_evidence.py covers stacks deciding.
METRICS_ONLY = "[capture]\nenabled = false\n"


def health(url: str) -> int:
    return requests.get(f"{url}/health", timeout=5).status_code


def page_value(server: VllmServer, name: str) -> float:
    """A series summed over its labels (request_success_total has one per finished_reason)."""
    sums = sample_sums(server.metrics(), (name,))
    assert name in sums, f"{name} not on the page"
    return sums[name]


@pytest.mark.versions
def test_the_scrape_reads_the_filtered_page_and_it_reads_as_the_whole_page(shared_vllm: VllmServer) -> None:
    """vLLM 0.32 answers /metrics/?name[]=... from prometheus_client's app: the scrape keeps the filter after
    checking it against the whole page, and both read the same series."""
    fetcher = MetricsFetcher(shared_vllm.url)
    try:
        first = fetcher.scrape()
        assert first.page is not None and first.page.engines, first.error
        assert fetcher.filtering, "the filter was found wanting on the real vLLM"
        whole = read_page(shared_vllm.metrics())
        assert first.size < len(shared_vllm.metrics().encode()) / 5
        assert {(n, e.running is not None, e.waiting is not None, e.kv_usage is not None, tuple(sorted(e.counters)))
                for n, e in first.page.engines.items()} == \
               {(n, e.running is not None, e.waiting is not None, e.kv_usage is not None, tuple(sorted(e.counters)))
                for n, e in whole.engines.items()}
    finally:
        fetcher.http.close()


def test_steady_load_is_never_frozen(shared_vllm: VllmServer, watch: Watch) -> None:
    server = shared_vllm
    w = watch(server.url, extra=METRICS_ONLY)
    w.wait_for_state("idle", 60)
    with LoadGenerator(server.url, server.model_name, threads=4, duration=70) as load:
        w.wait_for_state("working", 30)
        time.sleep(65)
    stats = load.stats
    assert stats.successes > 20, stats
    states = w.states()
    assert "frozen" not in states and "suspect" not in states, w.events()


def test_idle_engine_is_idle_and_probes_succeed(
    shared_vllm: VllmServer, watch: Watch
) -> None:
    server = shared_vllm
    w = watch(server.url, extra=METRICS_ONLY, probe=10.0)
    w.wait_for_state("idle", 60)
    before = page_value(server, "vllm:request_success_total")
    time.sleep(62)
    assert w.current() == "idle"
    assert set(w.states()) <= {"starting", "idle"}, w.events()
    # the probes are real generations: about one every 10 s, each finished as a successful request
    assert page_value(server, "vllm:request_success_total") - before >= 4


@pytest.mark.versions
def test_long_prefill_longer_than_the_window_is_never_frozen(
    vllm: Callable[..., VllmServer], slow_model: Path, watch: Watch
) -> None:
    """Chunked prefill: every counter flat for well over the window, only KV usage moves. The window here is 8 s; the
    prompt is sized to last about 20 s by timing a shorter one on this server first."""
    server = vllm(slow_model, max_model_len=8192, max_num_batched_tokens=128)
    tokens = calibrated_tokens(server.url, server.model_name, 20.0, most=8192 - 16)
    w = watch(server.url, extra=METRICS_ONLY, suspect=4.0, window=8.0, probe=60.0)
    w.wait_for_state("idle", 60)
    t0 = time.monotonic()
    req = BackgroundRequest(server.url, server.model_name, long_prompt(tokens), max_tokens=1, timeout=300)
    result = req.result(timeout=300)
    took = time.monotonic() - t0
    assert result.ok, result
    assert took > 8.0 * 1.5, f"the prefill of {tokens} tokens took only {took:.1f}s: not longer than the window"
    assert "working" in w.states()
    assert "frozen" not in w.states() and "suspect" not in w.states(), w.events()
    print(f"prefill of {tokens} tokens took {took:.1f}s (window 8 s): never suspect or frozen")


@pytest.mark.versions
def test_stopped_worker_under_load_is_frozen_within_the_window(
    shared_vllm: VllmServer, watch: Watch
) -> None:
    server = shared_vllm
    w = watch(server.url, extra=METRICS_ONLY, suspect=5.0, window=15.0)
    w.wait_for_state("idle", 60)
    with LoadGenerator(server.url, server.model_name, threads=4, duration=120, request_timeout=200):
        w.wait_for_state("working", 30)
        server.wait_running(1, 30)
        with frozen(server.process("VLLM::Worker_TP1")):
            stopped_at = time.time()
            # a deadline, not the measure: how soon a freeze is declared is bench/bench_engine.py's ("metrics only")
            event = w.wait_for_state("frozen", 15 + 45, after=stopped_at)
            assert health(server.url) == 200  # the point of the tool: /health still says all is well
            assert page_value(server, "vllm:num_requests_running") > 0
        # declared by the metric window (stacks are off here): the stall it judged is the whole window
        stalled = re.search(r"no progress for (\d+)s with work pending", event["reason"])
        assert stalled and int(stalled[1]) >= 15, event
        print(f"frozen {event_time(event) - stopped_at:.1f}s after the stop (metrics only, window 15 s)")
        w.wait_for_state("working", 60, after=event_time(event))  # and it recovers once continued


@pytest.mark.versions
def test_invisible_wedge_after_idle_is_found_by_the_probe(
    shared_vllm: VllmServer, watch: Watch
) -> None:
    server = shared_vllm
    w = watch(server.url, extra=METRICS_ONLY, suspect=5.0, window=15.0, probe=5.0)
    w.wait_for_state("idle", 60)
    with frozen(server.process("VLLM::Worker_TP1")):
        stopped_at = time.time()
        req = BackgroundRequest(server.url, server.model_name, "hello there", max_tokens=4, timeout=120)
        event = w.wait_for_state("frozen", 5 + 15 + 15, after=stopped_at)
        assert "probe" in event["reason"], event
        print(f"frozen {event_time(event) - stopped_at:.1f}s after the stop (probe 5 s, window 15 s)")
        assert page_value(server, "vllm:num_requests_running") == 0  # the page never showed the stuck request
        assert page_value(server, "vllm:num_requests_waiting") == 0
        assert not req.done()
    assert req.result(timeout=120).ok
    w.wait_for_state("idle", 60, after=event_time(event))


@pytest.mark.ends_shared_server
def test_killed_worker_is_down_then_starting_then_idle_after_restart(
    shared_vllm: VllmServer, vllm: Callable[..., VllmServer], fast_model: Path, watch: Watch
) -> None:
    server = shared_vllm  # vLLM shuts itself down once a worker is killed: the pool replaces it afterwards
    w = watch(server.url, extra=METRICS_ONLY)
    w.wait_for_state("idle", 60)
    killed_at = time.time()
    kill(server.process("VLLM::Worker_TP1"))
    down = w.wait_for_state("down", 60, after=killed_at)
    server.stop()
    again = vllm(fast_model, port=server.port, wait=False)
    starting = w.wait_for_state("starting", 120, after=event_time(down))
    again.wait_ready(300)
    w.wait_for_state("idle", 60, after=event_time(starting))
    assert "frozen" not in w.states()


@pytest.mark.versions
def test_startup_is_starting_never_frozen(vllm: Callable[..., VllmServer], fast_model: Path, watch: Watch) -> None:
    from tests.harness.server import free_port

    port = free_port()
    w = watch(f"http://127.0.0.1:{port}", extra=METRICS_ONLY, suspect=3.0, window=6.0)
    w.wait_for_state("down", 30, engine="server")  # it has seen the port closed, with no server for it
    server = vllm(fast_model, port=port, wait=False)
    w.wait_for_state("starting", 120)
    server.wait_ready(300)
    w.wait_for_state("idle", 60)
    states = w.states()
    assert "frozen" not in states and "suspect" not in states, w.events()
