"""Smoke tests of the real-engine harness itself: a real vLLM, TP=2, on the CPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import pytest

from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.metrics import watched
from tests.harness.server import VllmServer

pytestmark = pytest.mark.engine

TITLES = {"api_server", "VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"}
GEN = "vllm:generation_tokens_total"


def wait_for(predicate: Callable[[], bool], timeout: float, period: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def test_tp2_server_runs_its_processes_and_load_moves_the_counters(shared_vllm: VllmServer) -> None:
    server = shared_vllm
    procs = server.processes()
    assert set(procs) >= TITLES, sorted(procs)
    assert procs["api_server"].pid == server.pid
    assert procs["VLLM::EngineCore"].ppid() == server.pid

    before = watched(server.metrics())[GEN]
    with LoadGenerator(server.url, server.model_name, threads=4, duration=120) as load:
        assert wait_for(lambda: watched(server.metrics())[GEN] >= before + 50, timeout=60)
        mid = watched(server.metrics())
        assert mid["vllm:num_requests_running"] >= 1
    assert load.stats.successes > 0, load.stats
    assert load.stats.failures == 0, load.stats.errors
    assert watched(server.metrics())[GEN] > before


@pytest.mark.ends_shared_server
def test_frozen_worker_is_continued_and_stop_ends_the_whole_session(shared_vllm: VllmServer) -> None:
    server = shared_vllm  # stopped below: the pool starts another for a later user
    tp1 = server.process("VLLM::Worker_TP1")

    with LoadGenerator(server.url, server.model_name, threads=4, duration=120):
        assert wait_for(lambda: watched(server.metrics())["vllm:num_requests_running"] >= 1, timeout=30)
        with frozen(tp1):
            assert tp1.status() == psutil.STATUS_STOPPED
            time.sleep(2)  # let the step in flight wait on the stopped rank
            stuck = watched(server.metrics())[GEN]
            time.sleep(3)
            assert watched(server.metrics())[GEN] == stuck, "tokens moved with a rank stopped"
        assert tp1.status() != psutil.STATUS_STOPPED
        assert wait_for(lambda: watched(server.metrics())[GEN] > stuck, timeout=30), "no progress after SIGCONT"

    members = server.session_processes()
    assert len(members) >= 4
    with frozen(server.process("VLLM::Worker_TP0")):
        server.stop()  # must SIGCONT the stopped rank itself, then end everything
        assert server.session_processes() == []
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in members)
    server.stop()  # idempotent
