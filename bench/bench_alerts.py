"""The alert dispatcher's promises in numbers: `submit` costs microseconds whatever the sinks do, and `close` cuts a
long retry backoff short.

    .venv/bin/python bench/bench_alerts.py [--submits 2000] [--out bench/results/alerts.json]

The unit tests (tests/unit/test_alerts.py) prove the behaviour without a clock (submit returns while the sink is
held; the worker ends although its backoff had an hour to run); the times belong here:

- submit with a healthy sink, a stuck sink (send never returns) and a stuck sink behind a full queue (every alert
  dropped): median, p99 and max of one call, wall time;
- close(timeout=0.2) while the worker waits out a 30 s backoff after a refused connection: how long close takes.

The targets: submit under 1 ms at p99 in every case; close within its timeout plus its 1 s join.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from watchdog.act.alerts import Alert, Dispatcher, RetryPolicy, WebhookSink  # noqa: E402


def alert(i: int) -> Alert:
    return Alert("stall_detected", f"inc-{i}", engine="0", stack="bench", url="http://127.0.0.1:8000",
                 state="frozen", summary="bench", details={}, time=time.time())


class Fast:
    name = "fast"

    def send(self, a: Alert) -> None:
        pass


class Stuck:
    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()

    def send(self, a: Alert) -> None:
        self.release.wait(60)


def submit_times(sink: Fast | Stuck, n: int, queue_size: int) -> dict[str, float]:
    d = Dispatcher([sink], RetryPolicy.instant(), queue_size=queue_size)
    times = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            d.submit(alert(i))
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        if isinstance(sink, Stuck):
            sink.release.set()
        d.close(timeout=2)
    times.sort()
    return {"median_us": round(statistics.median(times), 1), "p99_us": round(times[int(len(times) * 0.99)], 1),
            "max_us": round(times[-1], 1), "submits": n}


def close_time() -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    backing_off = threading.Event()

    class Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying in" in record.getMessage():
                backing_off.set()

    logger = logging.getLogger("watchdog.act.alerts")
    handler = Signal()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        d = Dispatcher([WebhookSink(url)], RetryPolicy(attempts=5, wait_initial=30, wait_max=30, jitter=0))
        d.submit(alert(0))
        if not backing_off.wait(10):
            raise RuntimeError("the first attempt never failed")
        t0 = time.perf_counter()
        stopped = d.close(timeout=0.2)
        took = time.perf_counter() - t0
    finally:
        logger.removeHandler(handler)
    return {"close_s": round(took, 3), "backoff_s": 30.0, "close_timeout_s": 0.2, "returned": stopped}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--submits", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "alerts.json"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # "queue full" warnings: thousands, on purpose
    out = {
        "submit_fast_sink": submit_times(Fast(), a.submits, 256),
        "submit_stuck_sink": submit_times(Stuck(), min(a.submits, 200), 256),
        "submit_stuck_sink_full_queue": submit_times(Stuck(), a.submits, 1),
        "close_during_30s_backoff": close_time(),
    }
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
