"""Recovery of a real vLLM (CPU build, TP=2) through the command strategy: a worker freezes under load, the
watchdog takes the stacks, alerts a real receiver, runs the restart command, and proves the new server serves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.restart_vllm import read_pid, stop_group
from tests.harness.server import VllmServer, free_port
from tests.harness.watcher import WatchdogProcess, event_time, quick_config
from tests.receiver import Receiver

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).resolve().parents[1] / "harness" / "restart_vllm.py"


class ScriptedServer:
    """A vLLM started and restarted only by the restart script, as the watchdog's command strategy will."""

    def __init__(self, engine_python: Path, model: Path, tmp: Path) -> None:
        self.port, self.model = free_port(), model
        self.pidfile, self.log_dir = tmp / "vllm.pid", tmp / "logs"
        self.argv = [sys.executable, str(SCRIPT), "--pidfile", str(self.pidfile), "--python", str(engine_python),
                     "--model", str(model), "--port", str(self.port), "--log-dir", str(self.log_dir)]
        self.url = f"http://127.0.0.1:{self.port}"

    def run_script(self, *extra: str) -> None:
        subprocess.run([*self.argv, *extra], check=True, timeout=120, capture_output=True, start_new_session=True)

    @property
    def pid(self) -> int:
        pid = read_pid(self.pidfile)
        assert pid is not None
        return pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = requests.post(f"{self.url}/v1/completions", timeout=15,
                                  json={"model": self.model.name, "prompt": "ready", "max_tokens": 1})
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise AssertionError(f"vLLM not ready in {timeout}s:\n{self.log_tail()}")

    def process(self, title: str) -> psutil.Process:
        root = psutil.Process(self.pid)
        for p in [root, *root.children(recursive=True)]:
            if title in " ".join(p.cmdline()) or p.name() == title:
                return p
        raise AssertionError(f"no {title} process under pid {self.pid}")

    def log_tail(self, n: int = 40) -> str:
        logs = sorted(self.log_dir.glob("*.log"))
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-n:]) if logs else ""


@pytest.fixture
def scripted(engine_python: Path, fast_model: Path, tmp_path: Path) -> Iterator[ScriptedServer]:
    s = ScriptedServer(engine_python, fast_model, tmp_path)
    try:
        yield s
    finally:
        pid = read_pid(s.pidfile)
        if pid is not None:
            stop_group(pid)


def restart_config(server: ScriptedServer, hook: str, extra: str = "") -> str:
    return quick_config(10.0, 25.0, 10.0, f"""
[capture]
timeout = 30.0
[restart]
boot_timeout = 300.0
evidence_timeout = 120.0
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


def wait_event(wd: WatchdogProcess, name: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in wd.events() if e["event"] == name]
        if found:
            return found[0]
        time.sleep(0.3)
    raise AssertionError(f"no {name} event in {timeout}s: {[e['event'] for e in wd.events()]}\n{wd.log_tail(60)}")


def test_frozen_worker_is_captured_alerted_restarted_and_serving_again(
        scripted: ScriptedServer, receiver: Callable[..., Receiver], tmp_path: Path) -> None:
    hook = receiver()
    scripted.run_script()
    scripted.wait_ready(300)
    first_pid = scripted.pid
    wd = WatchdogProcess(scripted.url, tmp_path / "wd", restart_config(scripted, hook.url)).start()
    try:
        wd.wait_for_state("idle", 120)
        with LoadGenerator(scripted.url, scripted.model.name, threads=4, duration=300, request_timeout=400):
            time.sleep(3)
            with frozen(scripted.process("VLLM::Worker_TP1")):
                started = wait_event(wd, "restart_started", 180)
            recovered = wait_event(wd, "recovered", 360)
        resolved = wait_event(wd, "resolved", 30)
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
    assert recovered["incident"] == started["incident"] == resolved["incident"]
    deadline = time.monotonic() + 30
    while len(hook.received) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [b["event"] for b in hook.bodies()] == ["stall_detected", "evidence_captured", "restart_started",
                                                  "recovered", "resolved"]
    ev = hook.bodies()[1]["details"]
    assert ev["verdict"] == "stuck" and ev["bundle"] == str(bundle)
    frozen_at = next(event_time(e) for e in events if e.get("to") == "frozen")
    print(f"frozen -> restart_started {event_time(started) - frozen_at:.1f}s, "
          f"restart_started -> recovered {event_time(recovered) - event_time(started):.1f}s")
