"""A real HTTP receiver on loopback for alert tests: records what it accepted, answers as a test scripts it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

# behaviour: (hit number from 1) -> (status, delay in seconds before answering)
Behaviour = Callable[[int], tuple[int, float]]


def ok(_n: int) -> tuple[int, float]:
    return 200, 0.0


class Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.hits += 1
            n = self.server.hits
        status, delay = self.server.behaviour(n)
        if delay:
            self.server.stop.wait(delay)
        if 200 <= status < 300:
            # recorded before answering: once the client has its answer, the alert is here (a client that timed
            # out meanwhile may still have reached us, as the module's docstring warns receivers)
            with self.server.lock:
                self.server.received.append((self.path, dict(self.headers), body))
                # kept in arrival order: this thread may record after the next request's thread
                self.server.order.append(n)
                pairs = sorted(zip(self.server.order, self.server.received, strict=True), key=lambda p: p[0])
                self.server.order[:] = [k for k, _ in pairs]
                self.server.received[:] = [r for _, r in pairs]
        try:
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
        except OSError:  # the client timed out and left
            return

    def log_message(self, format: str, *args: object) -> None:
        pass


class Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, behaviour: Behaviour) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.behaviour = behaviour
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.hits = 0
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.order: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def bodies(self) -> list[Any]:
        with self.lock:
            return [json.loads(b) for _p, _h, b in self.received]


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    started: list[tuple[Receiver, threading.Thread]] = []

    def start(behaviour: Behaviour = ok) -> Receiver:
        srv = Receiver(behaviour)
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        started.append((srv, t))
        return srv

    yield start
    for srv, t in started:
        srv.stop.set()
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


