"""A webhook receiver to run as a unit (e.g. inside a throwaway systemd): records every POST, answers 200.

    python alert_sink_main.py --port 9999 --out /run/alerts/received.jsonl

Each POST becomes one JSON line in --out, written and synced before the answer: {"path", "headers", "body_b64"}
(the exact body bytes, so a test can check an HMAC over them). Standard library only (plus systemd-python,
when present, for READY=1 once the port is bound: a Type=notify unit is active only when it listens).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    server: Sink

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        record = {"path": self.path, "headers": dict(self.headers), "body_b64": base64.b64encode(body).decode()}
        with self.server.lock, open(self.server.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        print(f"{self.address_string()} {format % args}", flush=True)


class Sink(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, out: str) -> None:
        super().__init__((host, port), Handler)
        self.out = out
        self.lock = threading.Lock()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True, help="JSON lines file, appended to")
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    srv = Sink(args.host, args.port, args.out)
    print(f"alert sink listening on {args.host}:{srv.server_address[1]}, recording to {args.out}", flush=True)
    if os.environ.get("NOTIFY_SOCKET"):
        try:
            from systemd import daemon
        except ImportError:
            pass
        else:
            daemon.notify("READY=1")
    srv.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
