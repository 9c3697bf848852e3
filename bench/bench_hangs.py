"""Benchmark (issue 26): the lost wake-up made inside the real vLLM 0.25.1 (CPU build, TP=2), judged by the real
`watchdog run` at its defaults (only the URL set), `--runs` times per part on one injected engine:

    .venv/bin/python bench/bench_hangs.py [--runs 5] [--parts idle,load] [--out bench/results/hangs-0.25.1.json]

- idle: the fault armed, the engine idle 3 s (its readers in their poll), one request: seconds from the request to
  the `frozen` event (the page shows idle gauges: the idle probe finds it), and whether the bundle says poll-parking
  SUPPORTED with the ring's unread block; then the fault lifted (the dropped notify is sent late) and the request
  completes;
- load: two streams of load, the fault armed with its writes slowed past the readers' busy spin: seconds from the
  fault to `frozen`, the same checks.

The median, min and max of each part and the machine's load average at its start go to the JSON and the .md beside
it. One vLLM at a time: stop any other first (the machine has 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import engine_env, models
from tests.harness.inject import Injected, injected_vllm
from tests.harness.load import BackgroundRequest, LoadGenerator
from tests.harness.watcher import WatchdogProcess, event_time


def bundle(w: WatchdogProcess, after: float) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = [e for e in w.events() if e["event"] == "evidence_captured" and event_time(e) >= after]
        if got:
            m: dict[str, Any] = json.loads((Path(got[0]["bundle"]) / "manifest.json").read_text())
            return m
        time.sleep(0.3)
    return {}


def one(inj: Injected, state: Path, part: str) -> dict[str, Any]:
    url = inj.server.url
    w = WatchdogProcess(url, state, f'[engine]\nurl = "{url}"\n').start()
    load = None
    try:
        w.wait_for_state("idle", 90)
        if part == "idle":
            inj.fault("lost_wakeup")
            time.sleep(3.0)
            began = time.time()
            req = BackgroundRequest(url, inj.server.model_name, "after idle", max_tokens=4, timeout=300)
        else:
            load = LoadGenerator(url, inj.server.model_name, threads=2, max_tokens=(64, 64), request_timeout=300,
                                 duration=None).start()
            w.wait_for_state("working", 60)
            inj.fault("lost_wakeup_slow")
            began = time.time()
        frozen = w.wait_for_state("frozen", 120, after=began)
        m = bundle(w, event_time(frozen) - 30)
        inj.fault("")
        if part == "idle":
            req.result(120)
        return {"seconds": round(event_time(frozen) - began, 2), "stuck_kind": m.get("stuck_kind"),
                "poll_parking": (m.get("poll_parking") or {}).get("status"), "ring": m.get("ring"),
                "culprit": m.get("culprit")}
    finally:
        inj.fault("")
        if load is not None:
            load.stop()
        w.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--parts", default="idle,load")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "hangs-0.25.1.json"))
    a = ap.parse_args()
    python = engine_env.engine_python(version=engine_env.BEFORE_FIX_VERSION)
    model = models.ensure_model(models.FAST, python)
    out: dict[str, Any] = {"vllm": engine_env.BEFORE_FIX_VERSION, "runs": a.runs, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-hangs-") as tmp, \
            injected_vllm(python, model, Path(tmp), "vllm-bench-hangs") as inj:
        for part in a.parts.split(","):
            load_avg = os.getloadavg()[0]
            runs = [one(inj, Path(tmp) / f"{part}-{i}", part) for i in range(a.runs)]
            secs = [r["seconds"] for r in runs]
            out["parts"][part] = {"median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
                                  "supported": sum(r["poll_parking"] == "SUPPORTED" for r in runs),
                                  "lost_wakeup": sum(r["stuck_kind"] == "lost_wakeup" for r in runs),
                                  "load_average_at_start": round(load_avg, 2), "each": runs}
            print(f"{part}: median {statistics.median(secs):.1f} s ({min(secs):.1f}-{max(secs):.1f}); "
                  f"{out['parts'][part]['supported']}/{a.runs} SUPPORTED", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    rows = [f"| {p} | {v['median_s']:.1f} s | {v['min_s']:.1f}-{v['max_s']:.1f} s | {v['supported']}/{a.runs} | "
            f"{v['lost_wakeup']}/{a.runs} | {v['load_average_at_start']} |" for p, v in out["parts"].items()]
    Path(a.out).with_suffix(".md").write_text(
        f"# The lost wake-up on vLLM {out['vllm']} (bench/bench_hangs.py, {a.runs} runs per part)\n\n"
        "idle: from the stuck request to `frozen`; load: from the fault to `frozen`. The real `watchdog run` at its "
        "defaults.\n\n| part | median | range | poll-parking SUPPORTED | stuck_kind lost_wakeup | load average at "
        "start |\n| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
