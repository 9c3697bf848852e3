"""Benchmarks against a real vLLM (CPU build, TP=2): the watcher's footprint, and detection latency.

    .venv/bin/python bench/bench_engine.py [--minutes 5] [--freezes 5] [--out bench/results/engine.json]

1. Footprint: `watchdog run` at 1 Hz with default settings against the engine under load, for N minutes:
   its CPU share (utime+stime over wall time) and peak RSS (VmHWM), next to a reference in the same run: a
   naive watcher that GETs /metrics at 1 Hz and parses it whole with prometheus_client.
2. Detection: Worker_TP1 is stopped under load, N times; the latency is from the stop (the last moment
   progress was possible) to the `frozen` event. Median and max, with the default settings (stacks taken on
   suspicion confirm the freeze) and with stack capture off (the metric-only stall window decides).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness.engine_env import engine_python  # noqa: E402
from tests.harness.faults import frozen  # noqa: E402
from tests.harness.load import LoadGenerator  # noqa: E402
from tests.harness.metrics import watched  # noqa: E402
from tests.harness.models import fast_model  # noqa: E402
from tests.harness.server import VllmServer, free_port  # noqa: E402
from tests.harness.watcher import WatchdogProcess, event_time  # noqa: E402

NAIVE = """
import sys, time, requests
from prometheus_client.parser import text_string_to_metric_families
url = sys.argv[1]
while True:
    t0 = time.monotonic()
    try:
        for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=5).text):
            pass
    except Exception:
        pass
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
"""


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def footprint(server: VllmServer, workdir: Path, minutes: float) -> dict[str, float]:
    w = WatchdogProcess(server.url, workdir / "footprint", "", metrics_port=free_port()).start()  # defaults
    naive = subprocess.Popen([sys.executable, "-c", NAIVE, server.url], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        w.wait_for_state("idle", 60)
        assert w._popen is not None
        ours, ref = psutil.Process(w._popen.pid), psutil.Process(naive.pid)
        with LoadGenerator(server.url, server.model_name, threads=4, duration=minutes * 60 + 30):
            c0, r0, t0 = cpu_seconds(ours), cpu_seconds(ref), time.monotonic()
            time.sleep(minutes * 60)
            c1, r1, t1 = cpu_seconds(ours), cpu_seconds(ref), time.monotonic()
        wall = t1 - t0
        result = {
            "seconds": round(wall, 1),
            "watchdog_cpu_percent_of_a_core": round(100 * (c1 - c0) / wall, 3),
            "naive_cpu_percent_of_a_core": round(100 * (r1 - r0) / wall, 3),
            "watchdog_peak_rss_mb": round(peak_rss_mb(ours.pid), 1),
            "naive_peak_rss_mb": round(peak_rss_mb(ref.pid), 1),
            "frozen_events": w.states().count("frozen"),
        }
        # the cost of suspecting sooner: how often a healthy engine under load was suspected and its stacks taken
        events = [e for e in w.events() if event_time(e) >= w.started_at]
        result["suspect_transitions"] = sum(1 for e in events if e.get("event") == "transition"
                                            and e.get("to") == "suspect")
        result["evidence_checked_events"] = sum(1 for e in events if e.get("event") == "evidence_checked")
        result["longest_pending_gap_without_progress_s"] = longest_quiet(w.state_dir / "trace.jsonl")
        result["cpu_ratio_watchdog_to_naive"] = round(
            result["watchdog_cpu_percent_of_a_core"] / max(result["naive_cpu_percent_of_a_core"], 1e-9), 3)
        return result
    finally:
        os.killpg(naive.pid, signal.SIGKILL)
        naive.wait(10)
        w.stop()


def longest_quiet(trace: Path) -> float:
    """The longest stretch, in the trace, with work pending on the page and no counter or KV change."""
    longest, since, prev = 0.0, None, None
    for line in trace.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") != "scrape" or "engines" not in r or "0" not in r["engines"]:
            continue
        e = r["engines"]["0"]
        key = (sorted(e["counters"].items()), e["kv"])
        pending = (e.get("running") or 0) > 0 or (e.get("waiting") or 0) > 0
        if key != prev or not pending:
            since = r["wall"] if pending else None
        elif since is not None:
            longest = max(longest, r["wall"] - since)
        prev = key
    return round(longest, 2)


def capture_cost(server: VllmServer, captures: int) -> dict[str, object]:
    """What one capture (py-spy twice, capture.gap apart, on every engine process, as on a suspicion) costs the
    engine under load: generated tokens per second over a window holding one capture, against the window before
    it without one (same length, alternating)."""
    from watchdog.config.load import CaptureSection
    from watchdog.evidence.collect.capture import Capturer, find_pyspy

    gap = CaptureSection().gap
    capturer = Capturer(find_pyspy(), timeout=10)
    pids = [server.process(t).pid for t in ("VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1")]
    window = 10.0

    def tokens() -> float:
        return watched(requests.get(server.url + "/metrics", timeout=10).text)["vllm:generation_tokens_total"]

    quiet: list[float] = []
    busy: list[float] = []
    seconds: list[float] = []
    with LoadGenerator(server.url, server.model_name, threads=4, duration=captures * 2 * window + 60):
        time.sleep(10)
        for _ in range(captures):
            t0, n0 = time.monotonic(), tokens()
            time.sleep(window)
            t1, n1 = time.monotonic(), tokens()
            quiet.append((n1 - n0) / (t1 - t0))
            c0 = time.monotonic()
            first = capturer.dump_all(pids)
            time.sleep(gap)
            second = capturer.dump_all(pids)
            seconds.append(time.monotonic() - c0)
            assert all(d.ok for d in (*first.values(), *second.values()))
            time.sleep(max(0.0, window - (time.monotonic() - t1)))
            t2, n2 = time.monotonic(), tokens()
            busy.append((n2 - n1) / (t2 - t1))
    q, b = statistics.median(quiet), statistics.median(busy)
    return {"captures": captures, "window_s": window, "gap_s": gap, "capture_wall_s": [round(x, 2) for x in seconds],
            "tokens_per_s_without": [round(x, 1) for x in quiet], "tokens_per_s_with_one_capture": [round(x, 1)
                                                                                                  for x in busy],
            "median_without": round(q, 1), "median_with": round(b, 1),
            "throughput_ratio_with_to_without": round(b / q, 3) if q else None}


def last_progress_before(trace: Path, when: float) -> float | None:
    """Wall time of the last scrape, before ``when``, whose counters or KV usage differed from the one before."""
    last, prev = None, None
    for line in trace.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") != "scrape" or "engines" not in r:
            continue
        if r["wall"] > when:
            break
        e = r["engines"]["0"]
        key = (sorted(e["counters"].items()), e["kv"])
        if prev is not None and key != prev:
            last = r["wall"]
        prev = key
    return last


def detection(server: VllmServer, workdir: Path, freezes: int, config: str, name: str) -> dict[str, object]:
    w = WatchdogProcess(server.url, workdir / name, config).start()
    from_stop: list[float] = []
    from_progress: list[float] = []
    bundle_after_stop: list[float] = []
    try:
        w.wait_for_state("idle", 60)
        with LoadGenerator(server.url, server.model_name, threads=4, duration=freezes * 150, request_timeout=300):
            for _ in range(freezes):
                w.wait_for_state("working", 60, after=time.time() - 0.5)
                time.sleep(5)
                with frozen(server.process("VLLM::Worker_TP1")):
                    stopped = time.time()
                    event = w.wait_for_state("frozen", 120, after=stopped)
                    if "capture]\nenabled = false" not in config:
                        deadline = time.monotonic() + 60
                        while not (b := [e for e in w.events() if e.get("event") == "evidence_captured"
                                         and event_time(e) >= stopped]):
                            assert time.monotonic() < deadline
                            time.sleep(0.2)
                        bundle_after_stop.append(round(event_time(b[0]) - stopped, 2))
                frozen_at = event_time(event)
                from_stop.append(round(frozen_at - stopped, 2))
                last = last_progress_before(w.state_dir / "trace.jsonl", frozen_at)
                if last is not None:
                    from_progress.append(round(frozen_at - last, 2))
                since_progress = from_progress[-1] if from_progress else float("nan")
                print(f"  freeze {len(from_stop)}: frozen {from_stop[-1]:.1f}s after the stop, "
                      f"{since_progress:.1f}s after the last progress", flush=True)
                w.wait_for_state("working", 120, after=frozen_at)
    finally:
        w.stop()
    out: dict[str, object] = {
        "freezes": len(from_stop),
        "stop_to_frozen_s": from_stop, "median_stop_to_frozen_s": statistics.median(from_stop),
        "last_progress_to_frozen_s": from_progress,
        "median_last_progress_to_frozen_s": statistics.median(from_progress),
        "max_last_progress_to_frozen_s": max(from_progress),
    }
    if bundle_after_stop:
        out["stop_to_bundle_written_s"] = bundle_after_stop
        out["median_stop_to_bundle_written_s"] = statistics.median(bundle_after_stop)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--freezes", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine.json"))
    ap.add_argument("--footprint-json", help="reuse footprint figures from an earlier run's JSON")
    ap.add_argument("--captures", type=int, default=0, help="measure what N captures cost the engine under load")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        workdir = Path(tmp)
        server = VllmServer(engine_python(), fast_model(), workdir)
        with server:
            server.wait_ready(300)
            print(f"vLLM ready after {server.ready_after:.1f}s; footprint for {args.minutes} min ...", flush=True)
            results: dict[str, object] = {"uptime_load_before": os.getloadavg()}
            if args.footprint_json:
                results["footprint"] = json.loads(Path(args.footprint_json).read_text())
            if args.minutes > 0:
                results["footprint"] = footprint(server, workdir, args.minutes)
                print(json.dumps(results["footprint"], indent=2), flush=True)
            if args.captures:
                results["capture_cost"] = capture_cost(server, args.captures)
                print(json.dumps(results["capture_cost"], indent=2), flush=True)
            results["uptime_load_after"] = os.getloadavg()
            for name, config in (("detection_default", ""),
                                 ("detection_metrics_only", "[capture]\nenabled = false\n"))[:2 if args.freezes else 0]:
                print(f"{name}: {args.freezes} freezes ...", flush=True)
                results[name] = detection(server, workdir, args.freezes, config, name)
                print(json.dumps(results[name], indent=2), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
