"""Benchmark: a frozen engine out of HAProxy's rotation with the watchdog's /readyz, against vLLM's own /health.

    .venv/bin/python bench/bench_probes.py [--runs 1] [--threads 3] [--tp 1] [--out bench/results/probes.json]

Each run is tests/harness/lb_scenario.py: two real CPU vLLMs (TP=1), each watched by its own `watchdog run` with a
restart step, one real HAProxy with two proxies over the same two engines (`via_readyz` checks each watchdog's
/readyz, `via_health` vLLM's /health; a check every 1 s, out after 2 failures, back after 2), the same client loop
through each (threads, 4-24 tokens a request, 30 s client timeout), and one freeze: engine 1's worker stopped with
SIGSTOP until the watchdog's restart ends it. Per proxy, from HAProxy's admin socket (polled every 0.1 s), its
request log and the clients' own records:

- seconds from the fault, and from the watchdog's `frozen`, to the frozen engine marked DOWN (the targets: at most
  15 s and 5 s with /readyz; with /health: only once the restart has ended the engine, or never while it is frozen);
- requests in the episode (in flight at the fault, or sent before the engine was back in rotation) that failed or
  hung (no answer within the client's timeout), the client-seconds they cost, the longest stretch without any
  completion, and how many requests were sent to the frozen engine while it was frozen and after it was out.

Both proxies see the same engines, the same load and the same freeze in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import lb_scenario  # noqa: E402
from tests.harness.engine_env import engine_python  # noqa: E402
from tests.harness.models import fast_model  # noqa: E402

TARGET_AFTER_FROZEN = 5.0
TARGET_AFTER_FAULT = 15.0


def summary(runs: list[dict[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for px in lb_scenario.PROXIES:
        rows = [r["proxies"][px] for r in runs]  # type: ignore[index]

        def med(key: str, rows: list[dict[str, object]] = rows) -> float | None:
            vals = [float(x[key]) for x in rows if x[key] is not None]  # type: ignore[arg-type]
            return round(statistics.median(vals), 2) if vals else None

        out[px] = {key: med(key) for key in (
            "out_of_rotation_after_fault_s", "out_of_rotation_after_frozen_s", "failed", "hung",
            "client_seconds_lost", "longest_stretch_without_a_completion_s", "sent_to_frozen_engine_while_frozen",
            "sent_to_frozen_engine_after_out", "back_in_rotation_after_recovered_s")}
        out[px]["out_while_frozen"] = [x["out_while_frozen"] for x in rows]  # type: ignore[index]
    readyz = [r["proxies"]["via_readyz"] for r in runs]  # type: ignore[index]
    out["targets_met"] = all(
        x["out_of_rotation_after_frozen_s"] is not None and x["out_of_rotation_after_frozen_s"] <= TARGET_AFTER_FROZEN
        and x["out_of_rotation_after_fault_s"] <= TARGET_AFTER_FAULT for x in readyz)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=3, help="clients per proxy")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "probes.json"))
    a = ap.parse_args()
    runs = []
    for i in range(a.runs):
        tmp = tempfile.mkdtemp(prefix="bench-probes-")  # kept: the logs of engines, watchdogs and HAProxy
        r = lb_scenario.run(Path(tmp), engine_python(), fast_model(), tp=a.tp, threads=a.threads)
        r["workdir"] = tmp
        print(f"run {i + 1} ({tmp}): " + json.dumps(r["proxies"]), flush=True)
        runs.append(r)
    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs, "summary": summary(runs),
              "targets": {"out_after_frozen_s": TARGET_AFTER_FROZEN, "out_after_fault_s": TARGET_AFTER_FAULT}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
