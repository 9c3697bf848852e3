"""A real data-parallel vLLM (CPU build, ``--data-parallel-size 2``, TP=2 per engine: two EngineCores, four
workers all titled ``VLLM::Worker_TP0/1``, told to their engine by parent): two engines on one page, one
``watchdog run`` judging each. ``VLLM::EngineCore_DP1`` stopped under load on both: engine 1 `frozen` with its own
stacks and culprit, engine 0 working on and never frozen (issue 31: before, engine 0's worker in the model excused
engine 1's freeze: "a long step, not a freeze"); then the restart restarts the whole server (one server holds both
engines: `tests/harness/restart_vllm.py`, the command strategy), proven by a generation, both engines new."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.restart_vllm import ScriptedServer, read_pid, stop_group
from tests.harness.watcher import WatchdogProcess, event_time, quick_config

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


@pytest.fixture
def server(engine_python: Path, fast_model: Path, tmp_path: Path) -> Iterator[ScriptedServer]:
    s = ScriptedServer(engine_python, fast_model, tmp_path, tensor_parallel_size=2, data_parallel_size=2)
    try:
        yield s
    finally:
        pid = read_pid(s.pidfile)
        if pid is not None:
            stop_group(pid)


def cores(server: ScriptedServer) -> dict[str, int]:
    return {t: server.process(f"VLLM::{t}").pid for t in ("EngineCore_DP0", "EngineCore_DP1")}


def test_a_stopped_engine_core_freezes_its_engine_only_and_the_restart_restarts_the_server(
        server: ScriptedServer, tmp_path: Path) -> None:
    server.run_script()
    server.wait_ready(300)
    before = cores(server)
    root = psutil.Process(server.pid)
    titles = {" ".join(p.cmdline()).split(" ")[0] for p in [root, *root.children(recursive=True)]}
    assert {"VLLM::DPCoordinator", "VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1"} <= titles, titles
    restart = (f"[restart]\nboot_timeout = 300.0\nevidence_timeout = 120.0\nbudget = 1\n[[restart.steps]]\n"
               f'kind = "command"\nargv = {json.dumps(server.argv)}\ntimeout = 120\n')
    w = WatchdogProcess(server.url, tmp_path / "wd", quick_config(5.0, 40.0, 10.0, restart)).start()
    try:
        for engine in ("0", "1"):
            w.wait_for_state("idle", 90, engine=engine)
        with LoadGenerator(server.url, server.model.name, threads=6, duration=240, request_timeout=250):
            wait_both_running(server.url, 60)
            with frozen(server.process("VLLM::EngineCore_DP1")):
                stopped = time.time()
                event = w.wait_for_state("frozen", 60, engine="1", after=stopped)
                captured = wait_captured(w, "1", 60)
                started = w.wait_event("restart_started", 120)
            recovered = w.wait_event("recovered", 300)
        server.wait_ready(60)
        after = cores(server)
    finally:
        w.stop()
    theirs = [e for e in w.transitions() if e["engine"] == "0" and stopped <= event_time(e) < event_time(started)]
    assert not any(e["to"] == "frozen" for e in theirs), theirs
    assert "stacks confirm" in event["reason"], event
    assert "long step" not in event["reason"], event
    assert captured["culprit"] == "EngineCore_DP1", captured
    opened = [e for e in w.events() if e["event"] == "incident_opened"]
    assert [(e["engine"], e["kind"]) for e in opened] == [("1", "frozen")], opened  # one incident: engine 1's
    assert all(after[t] != before[t] for t in before), (before, after)  # the whole server restarted: both engines new
    print(f"data parallel: EngineCore_DP1 stopped -> engine 1 frozen {event_time(event) - stopped:.1f}s; "
          f"engine 0 before the restart: {[e['to'] for e in theirs]}; restart -> recovered "
          f"{event_time(recovered) - event_time(started):.1f}s")


def wait_captured(w: WatchdogProcess, engine: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in w.events() if e["event"] == "evidence_captured" and str(e.get("engine")) == engine]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no evidence_captured for engine {engine}: {[e['event'] for e in w.events()]}")
