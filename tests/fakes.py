"""Small hand-written fakes for unit tests. Integration tests use the real vLLM (tests/engine)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from watchdog.evidence.gpu.readings import GpuSample

# a config for tests against the fake: five scrapes a second, suspect after 1 s, frozen after 2 s, no stacks
FAST = """
[scrape]
interval = 0.2
[judge]
suspect_after = 1.0
stall_window = 2.0
[probe]
interval = 1.0
retry = 0.5
timeout = 3.0
[exporter]
port = 0
[capture]
enabled = false
"""


@dataclass
class EngineModel:
    """What the fake server's one engine reports. Tests change it while the server runs."""

    running: float = 0
    waiting: float = 0
    kv: float = 0.0
    gen: float = 0
    prompt: float = 0
    probe: str = "ok"  # ok | hang | error
    probes: int = 0
    restarts: int = 0  # POSTs to /_control/restart (what a restart command does to this fake)
    after_restart_running: float = 0  # work pending right after a restart (>0 with no progress: frozen again)
    lock: threading.Lock = field(default_factory=threading.Lock)
    release: threading.Event = field(default_factory=threading.Event)

    def page(self) -> str:
        lab = 'engine="0",model_name="fake"'
        return (
            "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{lab}}} {self.running}\n"
            f"vllm:num_requests_waiting{{{lab}}} {self.waiting}\n"
            f"vllm:kv_cache_usage_perc{{{lab}}} {self.kv}\n"
            f"vllm:generation_tokens_total{{{lab}}} {self.gen}\n"
            f"vllm:prompt_tokens_total{{{lab}}} {self.prompt}\n"
        )


class _Handler(BaseHTTPRequestHandler):
    """Keeps the connection open between requests (HTTP/1.1, every answer with its length), as vLLM's uvicorn does."""

    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, code: int, body: str, ctype: str = "text/plain; version=0.0.4") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        m = self.server.model
        if self.path == "/metrics" or self.path.startswith("/metrics/?"):  # its page holds only read samples
            with m.lock:
                self._send(200, m.page())
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": "fake"}]}), "application/json")
        else:
            self._send(404, "not found")

    def do_POST(self) -> None:
        m = self.server.model
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/_control/restart":  # a new incarnation: counters from zero
            with m.lock:
                m.restarts += 1
                m.gen = m.prompt = m.kv = 0
                m.running, m.waiting = m.after_restart_running, 0
                m.probe = "ok"
            self._send(200, "restarted")
            return
        if self.path != "/v1/completions":
            self._send(404, "not found")
            return
        if m.probe == "hang":
            m.release.wait(30)
            if m.probe != "hang":  # released by a restart: that connection died with the old incarnation
                self._send(503, "restarted")
                return
        if m.probe == "error":
            self._send(500, "engine error")
            return
        with m.lock:
            m.probes += 1
            m.gen += 1
            m.prompt += 8
        self._send(200, json.dumps({"choices": [{"text": "x"}]}), "application/json")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    model: EngineModel

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.open: set[socket.socket] = set()  # the connections kept open, ended with the server
        self.open_lock = threading.Lock()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self.open_lock:
            self.open.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.open_lock:
                self.open.discard(request)

    def end_connections(self) -> None:
        """An engine that is gone answers on no connection, kept open or not."""
        with self.open_lock:
            for conn in self.open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


@contextmanager
def fake_engine(model: EngineModel | None = None) -> Iterator[tuple[str, EngineModel]]:
    """A real HTTP server on loopback that speaks the few vLLM endpoints the watchdog uses."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.model = model or EngineModel()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.model
    finally:
        server.model.release.set()
        server.shutdown()
        server.server_close()
        server.end_connections()
        thread.join(5)


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class FakeGpuSource:
    """A ``GpuSource`` that replays prepared rounds of samples (one list per call), then the last one again."""

    def __init__(self, rounds: Sequence[list[GpuSample]], unavailable: str = "") -> None:
        self.rounds = list(rounds)
        self.unavailable = unavailable
        self.calls = 0

    def open(self) -> str:
        return self.unavailable

    def sample(self) -> list[GpuSample]:
        self.calls += 1
        if not self.rounds:
            return []
        return self.rounds[min(self.calls - 1, len(self.rounds) - 1)]


def read_pids(path: Path) -> list[int]:
    deadline = time.monotonic() + 10
    while not path.exists() or not path.read_text().endswith("\n"):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return [int(x) for x in path.read_text().split()]


def is_gone(pid: int, wait: float = 5.0) -> bool:
    """True once the pid no longer exists (a zombie left for a slow init to reap counts as gone after ``wait``)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
