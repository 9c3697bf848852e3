"""Recovery of a real vLLM (CPU build, TP=2) through the command strategy: a worker freezes under load, the
watchdog takes the stacks, alerts a real receiver, runs the restart command, and proves the new server serves."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.restart_vllm import ScriptedServer, read_pid, stop_group
from tests.harness.server import wait_running
from tests.harness.watcher import WatchdogProcess, event_time, quick_config
from tests.receiver import Receiver

pytestmark = pytest.mark.engine

@pytest.fixture
def scripted(engine_python: Path, fast_model: Path, tmp_path: Path) -> Iterator[ScriptedServer]:
    """Every server the restart script starts loads the tests' fault injection, inert until the flag names one."""
    flag = tmp_path / "fault"
    flag.write_text("")
    s = ScriptedServer(engine_python, fast_model, tmp_path, inject=flag)
    try:
        yield s
    finally:
        flag.write_text("")
        pid = read_pid(s.pidfile)
        if pid is not None:
            stop_group(pid)


def restart_config(server: ScriptedServer, hook: str, extra: str = "") -> str:
    marker = server.pidfile.with_name("pre-start-ran")
    # the hook copies the pid file as it finds it: the old server's pid if it ran before the start
    pre_start = [sys.executable, "-c", "import pathlib as p, sys; p.Path(sys.argv[1]).write_text(p.Path(sys.argv[2])"
                 ".read_text())", str(marker), str(server.pidfile)]
    return quick_config(10.0, 25.0, 10.0, f"""
[capture]
timeout = 30.0
log_file = {json.dumps(str(server.log_path))}
[restart]
boot_timeout = 300.0
evidence_timeout = 120.0
down_after = 5.0
pre_start = {json.dumps(pre_start)}
[[restart.steps]]
kind = "command"
argv = {json.dumps(server.argv)}
timeout = 120
[[alerts.sinks]]
kind = "webhook"
url = {json.dumps(hook)}
timeout = 30
{extra}
""")


def watched(scripted: ScriptedServer, hook: Receiver, tmp_path: Path) -> tuple[WatchdogProcess, int]:
    """A served vLLM and a watchdog that has seen it idle; the first server's pid."""
    scripted.run_script()
    scripted.wait_ready(300)
    wd = WatchdogProcess(scripted.url, tmp_path / "wd", restart_config(scripted, hook.url)).start()
    try:
        wd.wait_for_state("idle", 120)
    except BaseException:
        wd.stop()
        raise
    return wd, scripted.pid


def alerts_sent(hook: Receiver, count: int) -> list[str]:
    deadline = time.monotonic() + 30
    while len(hook.received) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return [b["event"] for b in hook.bodies()]


@pytest.mark.versions
def test_frozen_worker_is_captured_alerted_restarted_and_serving_again(
        scripted: ScriptedServer, receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    hook = receiver()
    wd, first_pid = watched(scripted, hook, tmp_path)
    try:
        with LoadGenerator(scripted.url, scripted.model.name, threads=4, duration=300, request_timeout=400):
            wait_running(scripted.url, 1, 30)
            with frozen(scripted.process("VLLM::Worker_TP1")):
                started = wd.wait_event("restart_started", 180)
            recovered = wd.wait_event("recovered", 360)
        resolved = wd.wait_event("resolved", 30)
        scripted.wait_ready(60)
    finally:
        wd.stop()
    events = wd.events()
    names = [e["event"] for e in events if e["event"] != "transition"]
    assert names.index("incident_opened") < names.index("restart_started") < names.index("recovered")
    captured = next(e for e in events if e["event"] == "evidence_captured")
    assert captured["decision"] == "stuck" and captured["culprit"] == "Worker_TP1", captured
    bundle = Path(captured["bundle"])
    assert (bundle / "summary.md").exists()
    assert event_time(captured) <= event_time(started), "evidence first, then the restart"
    assert scripted.pid != first_pid
    # the pre-start hook ran before the command step (the only start there is), while the old pid was current
    assert scripted.pidfile.with_name("pre-start-ran").read_text().strip() == str(first_pid)
    assert recovered["incident"] == started["incident"] == resolved["incident"]
    assert alerts_sent(hook, 5) == ["stall_detected", "evidence_captured", "restart_started",
                                                  "recovered", "resolved"]
    ev = hook.bodies()[1]["details"]
    assert ev["verdict"] == "stuck" and ev["bundle"] == str(bundle)
    frozen_at = next(event_time(e) for e in events if e.get("to") == "frozen")
    print(f"frozen -> restart_started {event_time(started) - frozen_at:.1f}s, "
          f"restart_started -> recovered {event_time(recovered) - event_time(started):.1f}s")


@pytest.mark.versions
def test_an_engine_that_crashes_is_alerted_with_its_error_restarted_and_serving_again(
        scripted: ScriptedServer, receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    """The engine's own crash: one request with a repetition penalty makes the sampler index outside a tensor
    (the injection's ``illegal_access``; on CUDA the illegal memory access), EngineCore dies of the failed step and
    the server exits. Down, its bundle with the log's error before the restart, then restarted and serving."""
    hook = receiver()
    wd, first_pid = watched(scripted, hook, tmp_path)
    try:
        (tmp_path / "fault").write_text("illegal_access")
        time.sleep(0.5)  # the engine re-reads the flag at most every 0.2 s
        r = requests.post(f"{scripted.url}/v1/completions", timeout=120, json={
            "model": scripted.model.name, "prompt": "hello", "max_tokens": 4, "repetition_penalty": 1.3})
        (tmp_path / "fault").write_text("")
        assert r.status_code == 500, r.text
        opened = wd.wait_event("incident_opened", 60)
        captured = wd.wait_event("evidence_captured", 60)
        started = wd.wait_event("restart_started", 60)
        recovered = wd.wait_event("recovered", 360)
        wd.wait_event("resolved", 30)
        scripted.wait_ready(60)
    finally:
        wd.stop()
    assert opened["kind"] == "down" and scripted.pid != first_pid
    assert started["incident"] == opened["incident"] == captured["incident"] == recovered["incident"]
    # the headline names the error the log holds, in the process that raised it, and its runbook
    said = "index 4398046511104 is out of bounds for dimension 0 with size 4 (IndexError in Worker_TP"
    assert captured["headline"].startswith(f"down: the engine died: {said}"), captured
    assert captured["runbook"] == "down-engine-error"
    bundle = Path(captured["bundle"])
    m = json.loads((bundle / "manifest.json").read_text())
    assert bundle.name == opened["incident"] and m["state"] == "down" and m["headline"] == captured["headline"]
    assert m["log_cause"]["exception"] == "IndexError" and m["log_cause"]["process"].startswith("Worker_TP")
    assert "IndexError: index 4398046511104" in (bundle / "log-tail.txt").read_text()
    assert event_time(captured) <= event_time(started), "the bundle first, then the restart"
    assert alerts_sent(hook, 5) == ["engine_down", "evidence_captured", "restart_started", "recovered", "resolved"]
    assert hook.bodies()[1]["summary"] == captured["headline"]
    print(f"incident_opened -> bundle {event_time(captured) - event_time(opened):.2f}s, "
          f"bundle -> restart_started {event_time(started) - event_time(captured):.2f}s")
