"""The README's demo: a real vLLM (CPU, TP=2), the watchdog with default settings, a frozen worker.

    ./scripts/demo                  (or: .venv/bin/python -m tests.harness.demo)
    ./scripts/demo --lost-wakeup    the hang this product exists for instead: vLLM 0.25.1 (before the fix), its
                                    notify to the workers lost inside the engine, one request after idle

Ends by itself and cleans up every process it started, also on Ctrl-C.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from tests.harness.engine_env import BEFORE_FIX_VERSION, engine_python
from tests.harness.faults import frozen
from tests.harness.inject import injected_env
from tests.harness.load import BackgroundRequest, LoadGenerator
from tests.harness.models import fast_model
from tests.harness.server import VllmServer
from tests.harness.watcher import WatchdogProcess, event_time
from watchdog.config.load import JudgeSection

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {text}", flush=True)


def follow(w: WatchdogProcess, stop: threading.Event) -> None:
    shown = 0
    while not stop.is_set():
        events = w.events()
        for e in events[shown:]:
            if e.get("event") == "transition":
                say(f"  watchdog: engine {e['engine']}: {e['from'] or '-'} -> {e['to'].upper()}: {e['reason']}")
            elif e.get("event") == "evidence_checked":
                say(f"  watchdog: stacks of every rank say {e['decision']}: {e['reason']}")
            elif e.get("event") == "evidence_captured":
                say(f"  watchdog: incident bundle {e['bundle']}: {e.get('headline')} (runbook {e.get('runbook')}; "
                    f"poll-parking {e['poll_parking']})")
        shown = len(events)
        time.sleep(0.2)


def check(url: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "watchdog", "check", "--url", url, "--seconds", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = json.loads(r.stdout)
    for e in out["engines"]:
        say(f"  `watchdog check` -> exit {r.returncode}: engine {e['engine']} {e['state']}: {e['reason']}")


def show_bundle(w: WatchdogProcess) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        captured = [e for e in w.events() if e.get("event") == "evidence_captured" and e.get("bundle")]
        if captured:
            summary = Path(captured[0]["bundle"]) / "summary.md"
            say(f"the incident's summary.md:\n\n{summary.read_text()}")
            return
        time.sleep(0.5)
    say("no incident bundle within 60 s")


def lost_wakeup() -> int:
    """vLLM 0.25.1 with the tests' injection: EngineCore's wake-up to its workers dropped, the ring written."""
    say(f"preparing vLLM {BEFORE_FIX_VERSION} (before the fix of the lost wake-up) and a small random model")
    python = engine_python(version=BEFORE_FIX_VERSION)
    model = fast_model()
    with tempfile.TemporaryDirectory(prefix="watchdog-demo-") as tmp:
        workdir = Path(tmp)
        flag = workdir / "fault"
        flag.write_text("")
        stop = threading.Event()
        server = VllmServer(python, model, workdir, env=injected_env(flag))
        watchdog = WatchdogProcess(server.url, workdir / "state", "")
        try:
            say(f"starting vLLM {BEFORE_FIX_VERSION} (CPU build, TP=2) on {server.url}")
            server.start()
            watchdog.start()
            threading.Thread(target=follow, args=(watchdog, stop), daemon=True).start()
            server.wait_ready(300)
            watchdog.wait_for_state("idle", 60)
            say("losing EngineCore's wake-up notify to its workers (the block is still written to the ring)")
            flag.write_text("lost_wakeup")
            time.sleep(3)
            sent = time.time()
            say("one request after idle: it never completes, and the page keeps its idle gauges")
            request = BackgroundRequest(server.url, server.model_name, "hello", max_tokens=4, timeout=300)
            event = watchdog.wait_for_state("frozen", 120, after=sent)
            say(f"FROZEN detected {event_time(event) - sent:.1f}s after the request (the idle probe found it)")
            show_bundle(watchdog)
            say("lifting the fault: the lost notify is sent late, the readers wake, the request completes")
            flag.write_text("")
            say(f"  the request: {'completed' if request.result(120).ok else 'failed'}")
            time.sleep(2)
            say("done: stopping the watchdog and vLLM")
        finally:
            flag.write_text("")
            stop.set()
            watchdog.stop()
            server.stop()
    say("every process the demo started has ended")
    return 0


def main() -> int:
    if "--lost-wakeup" in sys.argv[1:]:
        return lost_wakeup()
    say("preparing the engine venv and a small random model (cached after the first run)")
    python, model = engine_python(), fast_model()
    with tempfile.TemporaryDirectory(prefix="watchdog-demo-") as tmp:
        workdir = Path(tmp)
        stop = threading.Event()
        server = VllmServer(python, model, workdir)
        watchdog = WatchdogProcess(server.url, workdir / "state", "")
        try:
            say(f"starting vLLM (CPU build, TP=2) on {server.url}")
            server.start()
            watchdog.start()
            threading.Thread(target=follow, args=(watchdog, stop), daemon=True).start()
            server.wait_ready(300)
            say(f"vLLM served its first generation after {server.ready_after:.0f}s")
            watchdog.wait_for_state("idle", 60)
            with LoadGenerator(server.url, server.model_name, threads=4, duration=300, request_timeout=300):
                watchdog.wait_for_state("working", 60)
                time.sleep(10)
                say("freezing VLLM::Worker_TP1 with SIGSTOP (a wedged rank)")
                with frozen(server.process("VLLM::Worker_TP1")):
                    stopped = time.time()
                    health = requests.get(f"{server.url}/health", timeout=5).status_code
                    say(f"  vLLM's /health says {health}: it does not notice")
                    event = watchdog.wait_for_state("frozen", 120, after=stopped)
                    say(
                        f"FROZEN detected {event_time(event) - stopped:.1f}s after the worker stopped "
                        f"(default settings: suspect at {JudgeSection().suspect_after:g}s, then the stacks decide; "
                        "vLLM itself would act at 300s)"
                    )
                    check(server.url)
                    show_bundle(watchdog)
                    say("continuing the worker (SIGCONT)")
                watchdog.wait_for_state("working", 60, after=event_time(event))
            watchdog.wait_for_state("idle", 120, after=event_time(event))
            time.sleep(1)
            say("done: stopping the watchdog and vLLM")
        finally:
            stop.set()
            watchdog.stop()
            server.stop()
    say("every process the demo started has ended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
