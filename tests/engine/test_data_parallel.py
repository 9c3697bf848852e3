"""A real data-parallel vLLM (CPU build, ``--data-parallel-size 2``, TP=1): two engines on one page, one
``watchdog run`` judging each. ``VLLM::EngineCore_DP1`` stopped under load on both: engine 1 `frozen` with its own
stacks and culprit, engine 0 working on and never frozen (issue 31: before, engine 0's worker in the model excused
engine 1's freeze: "a long step, not a freeze")."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.server import VllmServer
from tests.harness.watcher import WatchdogProcess, event_time

pytestmark = pytest.mark.engine


def running(url: str, engine: str) -> float:
    page = requests.get(f"{url}/metrics", timeout=5).text
    m = re.search(r'^vllm:num_requests_running\{[^}]*engine="' + engine + r'"[^}]*\} (\S+)$', page, re.M)
    return float(m[1]) if m else 0.0


def wait_both_running(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running(url, "0") > 0 and running(url, "1") > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"not both engines running within {timeout}s")


def test_a_stopped_engine_core_freezes_its_engine_only(
        vllm: Callable[..., VllmServer], watch: Callable[..., WatchdogProcess]) -> None:
    server = vllm(tensor_parallel_size=1, extra_args=["--data-parallel-size", "2"], ready_timeout=300)
    titles = sorted(server.processes())
    assert {"VLLM::DPCoordinator", "VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1"} <= set(titles), titles
    w = watch(server.url, suspect=5.0, window=40.0)
    for engine in ("0", "1"):
        w.wait_for_state("idle", 90, engine=engine)
    with LoadGenerator(server.url, server.model_name, threads=6, duration=180, request_timeout=250):
        wait_both_running(server.url, 60)
        with frozen(server.process("VLLM::EngineCore_DP1")):
            stopped = time.time()
            event = w.wait_for_state("frozen", 60, engine="1", after=stopped)
            captured = wait_captured(w, "1", 60)
            time.sleep(5)  # engine 0 watched on beside the freeze
        w.wait_for_state("working", 60, engine="1", after=event_time(event))
    theirs = [e for e in w.transitions() if e["engine"] == "0" and event_time(e) >= stopped]
    assert not any(e["to"] == "frozen" for e in theirs), theirs
    assert "stacks confirm" in event["reason"], event
    assert "long step" not in event["reason"], event
    assert captured["culprit"] == "EngineCore_DP1", captured
    print(f"data parallel: EngineCore_DP1 stopped -> engine 1 frozen {event_time(event) - stopped:.1f}s; "
          f"engine 0: {[e['to'] for e in theirs]}")


def wait_captured(w: WatchdogProcess, engine: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in w.events() if e["event"] == "evidence_captured" and str(e.get("engine")) == engine]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no evidence_captured for engine {engine}: {[e['event'] for e in w.events()]}")
