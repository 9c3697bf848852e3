"""A loopback HTTP proxy in front of a real vLLM whose ``/metrics`` page a test can spoil: garbage or a hang.

Every other request (health, completions, models) goes through unchanged, so the watchdog's proof of recovery (a
generation) and its probes reach the real engine through the same URL. The modes:

- ``pass``: the real page;
- ``garbage``: 200 with a body that is no Prometheus text at all;
- ``hang``: the page's answer never comes (the handler waits until the mode changes or the proxy stops).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

MODES = ("pass", "garbage", "hang")
GARBAGE = b"\x00\x9f<html>not a page</html>\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{\n"
HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"})


class _Handler(BaseHTTPRequestHandler):
    server: PageProxy
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0)) if method == "POST" else None
        if self.path.startswith("/metrics"):
            mode = self.server.mode
            if mode == "hang":
                self.server.changed.wait_for_change("hang")
                mode = self.server.mode
            if mode == "garbage":
                return self._answer(200, {"Content-Type": "text/plain"}, GARBAGE)
        try:
            r = self.server.session.request(method, self.server.backend + self.path, data=body, timeout=300,
                                            headers={k: v for k, v in self.headers.items()
                                                     if k.lower() not in HOP and k.lower() != "host"})
        except requests.RequestException:
            return self._answer(502, {"Content-Type": "text/plain"}, b"backend unreachable\n")
        self._answer(r.status_code, {k: v for k, v in r.headers.items() if k.lower() not in HOP}, r.content)

    def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up and left
            pass

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Mode:
    """The mode, and a wait for it to leave one value (a hung handler's)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.value = "pass"
        self.closed = False

    def wait_for_change(self, value: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.value != value or self.closed, timeout=600)


class PageProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, backend: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.backend = backend.rstrip("/")
        self.session = requests.Session()
        self.changed = _Mode()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @property
    def mode(self) -> str:
        return self.changed.value

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown page mode {mode!r} (known: {', '.join(MODES)})")
        with self.changed.cond:
            self.changed.value = mode
            self.changed.cond.notify_all()

    def start(self) -> PageProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        with self.changed.cond:
            self.changed.closed = True
            self.changed.cond.notify_all()
        self.shutdown()
        self.server_close()
        self.session.close()
        self._thread.join(timeout=5)
