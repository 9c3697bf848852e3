"""What the 1 Hz scrape costs the engine's API server, whole or filtered with prometheus_client's ``name[]``
(only the samples the watchdog reads), and the watchdog's own CPU beside the naive watcher, on a real vLLM (CPU
build, TP=2).

Found with it: vLLM 0.32 answers ``/metrics`` from prometheus-fastapi-instrumentator's route, which ignores a query
(the page is as big with it), and ``/metrics/`` from prometheus_client's own app, which honours it; the scrape asks
``/metrics/?name[]=...`` (``watchdog.scrape.fetch.FILTERED``) and falls back to the whole page where that fails.

    .venv/bin/python bench/bench_page_filter.py [--seconds 90] [--out bench/results/page-filter.json]
    .venv/bin/python bench/bench_page_filter.py --footprint-only --against /tmp/base --out /tmp/fp.json

Phases of ``--seconds`` each, on the idle engine (so the API server's own work is its background only): nothing
scraping; a 1 Hz GET of the whole page; a 1 Hz GET of ``/metrics?name[]=...`` (ignored by vLLM 0.32); a 1 Hz GET of
the filtered page; nothing again. The API server's CPU is read from ``/proc/PID/task/*/schedstat`` (nanoseconds on
the CPU, every thread), and the difference to the phases without scrapes is what the scrapes cost it. Then the
service (`watchdog run`, defaults) and the naive watcher (GET + full prometheus_client parse) run side by side for
the same time, under load, measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_engine import NAIVE  # noqa: E402
from bench.profile_tick import on_cpu_ns, service_of  # noqa: E402
from bench.warm_engine import warm_engine  # noqa: E402
from tests.harness.load import LoadGenerator  # noqa: E402
from tests.harness.server import VllmServer, free_port  # noqa: E402
from tests.harness.watcher import WatchdogProcess  # noqa: E402
from watchdog.scrape.engine_http import EngineHTTP  # noqa: E402
from watchdog.scrape.fetch import FILTERED, WHOLE  # noqa: E402

IGNORED = WHOLE + FILTERED[len(WHOLE) + 1:]  # the same query on the instrumentator's route


def phase(api_pid: int, seconds: float, url: str, path: str | None) -> dict[str, float]:
    stop = threading.Event()
    sizes: list[int] = []

    def scrape() -> None:
        c = EngineHTTP(url)  # the scrape's own GET
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                assert path is not None
                sizes.append(len(c.get_page(path).body))
                stop.wait(max(0.0, 1.0 - (time.monotonic() - t0)))
        finally:
            c.close()

    t = threading.Thread(target=scrape, daemon=True) if path else None
    if t is not None:
        t.start()
    time.sleep(3)
    a, t0 = on_cpu_ns(api_pid), time.monotonic()
    time.sleep(seconds)
    b, wall = on_cpu_ns(api_pid), time.monotonic() - t0
    stop.set()
    if t is not None:
        t.join(10)
    return {"api_server_cpu_percent": round((b - a) / 1e9 / wall * 100, 4), "page_bytes": sizes[-1] if sizes else 0,
            "scrapes": len(sizes)}


def api_server_phases(api: int, seconds: float, url: str) -> dict[str, dict[str, float]]:
    """The API server's CPU with no scrape, the whole page, the query on /metrics, the filtered page, no scrape."""
    res: dict[str, dict[str, float]] = {}
    for name, path in (("no_scrape", None), ("whole_page_1hz", WHOLE), ("query_on_metrics_1hz", IGNORED),
                       ("filtered_page_1hz", FILTERED), ("no_scrape_again", None)):
        res[name] = phase(api, seconds, url, path)
        print(name, res[name], flush=True)
    base = (res["no_scrape"]["api_server_cpu_percent"] + res["no_scrape_again"]["api_server_cpu_percent"]) / 2
    for name in ("whole_page_1hz", "query_on_metrics_1hz", "filtered_page_1hz"):
        res[name]["cost_to_api_server_percent"] = round(res[name]["api_server_cpu_percent"] - base, 4)
    return res


def side_by_side(server: VllmServer, workdir: Path, seconds: float, against: str = "") -> dict[str, float]:
    """The service (defaults: exporter on) and the naive watcher under load; with ``against``, also the service of
    another checkout (`python -m watchdog` from that tree's root), so that a change is measured in one run."""
    w = WatchdogProcess(server.url, workdir / "service", "", metrics_port=free_port()).start()
    others = [subprocess.Popen([sys.executable, "-c", NAIVE, server.url], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    if against:
        others.append(service_of(against, server.url, workdir / "against"))
    try:
        w.wait_for_state("idle", 60)
        assert w._popen is not None
        pids = {"watchdog": w._popen.pid, "naive": others[0].pid}
        if against:
            pids["against"] = others[1].pid
        with LoadGenerator(server.url, server.model_name, threads=4, duration=seconds + 30):
            time.sleep(5)
            a, t0 = {k: on_cpu_ns(p) for k, p in pids.items()}, time.monotonic()
            time.sleep(seconds)
            b, wall = {k: on_cpu_ns(p) for k, p in pids.items()}, time.monotonic() - t0
        res = {f"{k}_cpu_percent": round((b[k] - a[k]) / 1e9 / wall * 100, 4) for k in a}
        for name in ("watchdog", "against") if against else ("watchdog",):
            res[f"ratio_naive_to_{name}"] = round(res["naive_cpu_percent"] / max(res[f"{name}_cpu_percent"], 1e-9), 1)
        res["frozen_events"] = w.states().count("frozen")
        return res
    finally:
        for p in others:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        w.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "page-filter.json"))
    ap.add_argument("--footprint-only", action="store_true",
                    help="only the service beside the naive watcher, under load (no API-server phases)")
    ap.add_argument("--against", default="", help="another checkout's service beside this one, under load")
    args = ap.parse_args()
    with warm_engine("bench-filter-") as (server, tmp):
        api = server.pid
        res: dict[str, object] = {"load_before": os.getloadavg(), "seconds": args.seconds}
        if not args.footprint_only:
            res.update(api_server_phases(api, args.seconds, server.url))
        res["service_vs_naive_under_load"] = side_by_side(server, tmp, args.seconds, args.against)
        print(res["service_vs_naive_under_load"], flush=True)
        res["load_after"] = os.getloadavg()
    out = Path(args.out)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
