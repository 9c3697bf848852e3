"""What the scrape's wake-ups cost: three minimal 1 Hz clients of the filtered page, side by side on a real vLLM
(CPU build, TP=2) under 4 streams of load, each in its own process, beside a Python that only sleeps (the floor).

    .venv/bin/python bench/bench_wakeups.py [--seconds 150] [--out bench/results/wakeups.json]

- ``block``: send, then read the answer (what the scrape's GET does). vLLM's uvicorn writes the head and the body in two
  segments, so the first receive often wakes for the head alone and a second waits for the body.
- ``ahead``: read the answer to the request sent at the end of the last pass (it arrived long ago), then send the
  next one: one wake-up a pass, but every page read is one interval old.
- ``lowat``: as ``block``, with SO_RCVLOWAT set to half the last answer, so that the kernel wakes the reader once
  most of the answer is there (an answer smaller than that, such as an error page, waits for the read timeout).

The figure of each is its CPU (``/proc/PID/task/*/schedstat``, every thread) per second, as a share of a core; the
difference between them is what a wake-up costs a 1 Hz Python loop on a loaded box. They answer whether reading
ahead or SO_RCVLOWAT would bring the service's CPU much closer to the naive watcher's twentieth.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.profile_tick import on_cpu_ns  # noqa: E402
from bench.warm_engine import warm_engine  # noqa: E402
from tests.harness.load import LoadGenerator  # noqa: E402
from watchdog.scrape.fetch import FILTERED  # noqa: E402

CLIENT = r'''
import select, socket, sys, time
port, mode, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
req = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/plain\r\n\r\n".encode()
s = socket.create_connection(("127.0.0.1", port), timeout=None)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, b"\x05" + b"\x00" * 15)  # 5 s, as a scrape's read timeout


def answer() -> bytes:
    buf = b""
    while True:
        more = s.recv(65536)
        if not more:
            raise SystemExit("closed")
        buf += more
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            continue
        head = buf[:end].lower()
        if b"transfer-encoding: chunked" in head:
            if buf.endswith(b"\r\n0\r\n\r\n"):
                return buf
            continue
        i = head.find(b"content-length:")
        j = head.find(b"\r\n", i)
        if len(buf) >= end + 4 + int(head[i + 15:j if j > 0 else None]):
            return buf


nxt = time.monotonic()
if mode == "ahead":
    s.sendall(req)
while True:
    nxt += 1.0
    if mode == "ahead":
        answer()
        s.sendall(req)
    else:
        s.sendall(req)
        got = answer()
        if mode == "lowat":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, len(got) // 2))
    select.select([], [], [], max(0.0, nxt - time.monotonic()))
'''
SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"
MODES = ("block", "ahead", "lowat")


def measure(port: int, seconds: float, workdir: Path, url: str, model: str) -> dict[str, float]:
    script = workdir / "client.py"
    script.write_text(CLIENT)
    procs = {m: subprocess.Popen([sys.executable, str(script), str(port), m, FILTERED], start_new_session=True)
             for m in MODES}
    procs["sleeping_python"] = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    try:
        with LoadGenerator(url, model, threads=4, duration=seconds + 30):
            time.sleep(5)
            a, t0 = {k: on_cpu_ns(p.pid) for k, p in procs.items()}, time.monotonic()
            time.sleep(seconds)
            b, wall = {k: on_cpu_ns(p.pid) for k, p in procs.items()}, time.monotonic() - t0
        for k, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"the {k} client ended early (exit {p.returncode})")
        res = {f"{k}_cpu_percent": round((b[k] - a[k]) / 1e9 / wall * 100, 4) for k in procs}
        res.update({f"{k}_us_per_pass": round((b[k] - a[k]) / 1e3 / wall, 1) for k in MODES})
        return res
    finally:
        for p in procs.values():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "wakeups.json"))
    args = ap.parse_args()
    with warm_engine("bench-wakeups-") as (server, tmp):
        port = int(server.url.rsplit(":", 1)[1])
        res: dict[str, object] = {"seconds": args.seconds, "load_before": os.getloadavg(),
                                  **measure(port, args.seconds, tmp, server.url, server.model_name),
                                  "load_after": os.getloadavg()}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
