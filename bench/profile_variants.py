"""Where the service's CPU goes at 1 Hz: `watchdog run` side by side with its pass cut down, against the recorded
page (bench/page_server.py, chunked as vLLM's uvicorn answers).

    .venv/bin/python bench/profile_variants.py [--seconds 120] [--variants raw,get,scrape,tick,full]

Each variant is the real service (its loop, its sleep, its exporter) whose pass does only part of the work:

- ``raw``: a GET of the filtered page over a plain socket, read to the end of the chunked body;
- ``get``: the same through the scrape's GET (`EngineHTTP.get_page`);
- ``scrape``: `MetricsFetcher.scrape` (the GET and reading the page);
- ``tick``: `Watcher.tick` (the scrape, fed to the judge and the trace);
- ``full``: the whole pass, as shipped.

Printed: microseconds of CPU per second (every thread, ``/proc/PID/task/*/schedstat``), one figure per variant.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.profile_tick import free_port, on_cpu_ns, start_server  # noqa: E402

VARIANTS = ("raw", "get", "scrape", "tick", "full")


def cut_down(variant: str) -> None:
    """Replace the daemon's pass by the variant's part of it (in this process, before the service starts)."""
    import socket
    from urllib.parse import urlsplit

    from watchdog.scrape.fetch import FILTERED, MetricsFetcher
    from watchdog.service import daemon
    from watchdog.service.watcher import Watcher

    whole = daemon.Daemon.one_pass
    raw: list[socket.socket] = []

    def one_pass(self: daemon.Daemon, watcher: Watcher) -> None:
        if variant == "raw":
            u = urlsplit(self.url)
            if not raw:
                raw.append(socket.create_connection((u.hostname or "127.0.0.1", u.port or 80)))
                raw[0].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw[0].sendall(f"GET {FILTERED} HTTP/1.1\r\nHost: {u.netloc}\r\nAccept: text/plain\r\n\r\n".encode())
            buf = b""
            while not buf.endswith(b"\r\n0\r\n\r\n"):
                more = raw[0].recv(65536)
                if not more:
                    raise ConnectionError("the page server closed the connection")
                buf += more
        elif variant == "get":
            fetcher = watcher.fetcher
            assert isinstance(fetcher, MetricsFetcher)
            fetcher.http.get_page(FILTERED, accept="text/plain")
        elif variant == "scrape":
            watcher.fetcher.scrape()
        elif variant == "tick":
            self._guard("scrape", watcher.tick)
        else:
            whole(self, watcher)

    daemon.Daemon.one_pass = one_pass  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--as-service", default="", help=argparse.SUPPRESS)  # the child: run the service, cut down
    args, rest = ap.parse_known_args()
    if args.as_service:
        cut_down(args.as_service)
        from watchdog.cli.main import main as service

        return service(rest)
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    server, url = start_server(chunked=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="profile-variants-") as tmp:
            for v in chosen:
                d = Path(tmp, v)
                d.mkdir()
                (d / "w.toml").write_text("[gpu]\nenabled = false\n")
                procs[v] = subprocess.Popen(
                    [sys.executable, __file__, "--as-service", v, "run", "--url", url, "--state-dir", str(d),
                     "--config", str(d / "w.toml"), "--metrics-port", str(free_port())],
                    cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(10)
            a, t0 = {v: on_cpu_ns(p.pid) for v, p in procs.items()}, time.monotonic()
            time.sleep(args.seconds)
            b, wall = {v: on_cpu_ns(p.pid) for v, p in procs.items()}, time.monotonic() - t0
            for v, p in procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"variant {v} ended early (exit {p.returncode})")
            print({v: round((b[v] - a[v]) / 1e3 / wall, 1) for v in procs}, "us of CPU per second")
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        server.kill()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
