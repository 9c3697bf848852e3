"""One real vLLM (the fast model, default options) shared by the engine tests that leave it as they found it.

Starting a TP=2 vLLM costs 30-60 s of a 2-core machine, most of an engine test. Tests that only read or load
the server (idle verdicts, steady load, evidence of an idle engine), or freeze a process and continue it, take
this one instead of starting their own. It is handed out only once it is proven healthy again:

- the API server, EngineCore and both workers are alive and none is stopped (state T) or a zombie;
- no request is running or waiting (the previous test's load has drained: the next one may judge idleness);
- a real generation succeeds.

Anything else, and it is stopped and a fresh one started. One vLLM at a time (2 cores): `release()` stops it
before any test starts a server of its own (tests/engine/conftest.py does that before such a test's set-up).
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import requests

from tests.harness.metrics import watched
from tests.harness.server import VllmServer

TITLES = ("api_server", "VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1")


def problem(server: VllmServer, drain_timeout: float = 90.0, generation_timeout: float = 60.0) -> str | None:
    """Why `server` cannot be handed to the next test, or None if it serves and is quiet."""
    if not server.is_alive():
        return f"exited with {server.exit_code()}"
    procs = server.processes()
    missing = [t for t in TITLES if t not in procs]
    if missing:
        return f"processes missing: {missing}"
    for title, proc in procs.items():
        try:
            status = proc.status()
        except psutil.Error as exc:
            return f"{title}: {type(exc).__name__}"
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE):
            return f"{title} is {status}"
    deadline = time.monotonic() + drain_timeout
    while True:
        try:
            page = watched(server.metrics())
        except requests.RequestException as exc:
            return f"/metrics: {type(exc).__name__}: {exc}"
        pending = page.get("vllm:num_requests_running", 0.0) + page.get("vllm:num_requests_waiting", 0.0)
        if pending == 0:
            break
        if time.monotonic() > deadline:
            return f"{pending:.0f} requests still pending after {drain_timeout:.0f} s"
        time.sleep(0.5)
    try:
        body = server.complete("are you there", max_tokens=2, timeout=generation_timeout)
    except requests.RequestException as exc:
        return f"generation failed: {type(exc).__name__}: {exc}"
    if not body.get("choices"):
        return f"generation without choices: {body}"
    return None


class SharedVllm:
    """At most one shared server at a time; `acquire()` hands out a healthy one, `release()` stops it."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.server: VllmServer | None = None
        self.started = 0  # servers started over the session
        self.handed_out = 0  # acquisitions over the session
        self.replaced: list[str] = []  # why a server was not reused

    def acquire(self, python: Path, model: Path, ready_timeout: float = 240.0) -> VllmServer:
        if self.server is not None:
            why = problem(self.server)
            if why is not None:
                self.replaced.append(f"{self.server.name}: {why}")
                print(f"shared vLLM {self.server.name} not reused: {why}", flush=True)
                self.release()
        if self.server is None:
            server = VllmServer(python, model, self.log_dir, name=f"shared-vllm-{self.started}")
            self.started += 1
            self.server = server  # before start(): release() must stop it even if start or readiness fails
            try:
                server.start()
                server.wait_ready(ready_timeout)
            except BaseException:
                self.release()
                raise
        self.handed_out += 1
        return self.server

    def release(self) -> None:
        """Stop the shared server, if there is one (SIGCONT first: see VllmServer.stop)."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def has_stopped_process(self) -> bool:
        if self.server is None:
            return False
        for proc in self.server.session_processes():
            try:
                if proc.status() == psutil.STATUS_STOPPED:
                    return True
            except psutil.Error:
                continue
        return False
