"""Wall time to capture 2, 4 and 8 engine processes with py-spy: parallel against serial, in the same run.

    .venv/bin/python bench/bench_capture.py [--repeats 5] [--out bench/results/capture.json]

The processes are the real TP=2 vLLM's (EngineCore, Worker_TP0, Worker_TP1, the API server), under load,
plus extra real Python processes (each running a small busy loop) to reach the count.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness.engine_env import engine_python  # noqa: E402
from tests.harness.load import LoadGenerator  # noqa: E402
from tests.harness.models import fast_model  # noqa: E402
from tests.harness.server import VllmServer  # noqa: E402
from watchdog.evidence.collect.capture import Capturer, find_pyspy  # noqa: E402

BUSY = """
import time
def step(n):
    return sum(i * i for i in range(n))
while True:
    step(20000)
    time.sleep(0.01)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "capture.json"))
    args = ap.parse_args()
    capturer = Capturer(find_pyspy(), timeout=20)
    extras: list[subprocess.Popen[bytes]] = []
    results: dict[str, object] = {"pyspy": capturer.pyspy, "repeats": args.repeats, "counts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        server = VllmServer(engine_python(), fast_model(), Path(tmp))
        try:
            with server:
                server.wait_ready(300)
                engine = [server.process(t).pid for t in ("VLLM::EngineCore", "VLLM::Worker_TP0",
                                                         "VLLM::Worker_TP1")] + [server.pid]
                for _ in range(4):
                    extras.append(subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True))
                time.sleep(1)
                pool = engine + [p.pid for p in extras]
                with LoadGenerator(server.url, server.model_name, threads=4, duration=600):
                    for n in (2, 4, 8):
                        pids = pool[:n]
                        row: dict[str, float] = {}
                        for mode, fn in (("serial", capturer.dump_serial), ("parallel", capturer.dump_all)):
                            times = []
                            for _ in range(args.repeats):
                                t0 = time.monotonic()
                                dumps = fn(pids)
                                times.append(time.monotonic() - t0)
                                bad = [d.error for d in dumps.values() if not d.ok]
                                assert not bad, bad
                            row[f"{mode}_median_s"] = round(statistics.median(times), 3)
                        speedup = row["serial_median_s"] / row["parallel_median_s"]
                        row["speedup_serial_over_parallel"] = round(speedup, 2)
                        print(n, row, flush=True)
                        results["counts"][str(n)] = row  # type: ignore[index]
        finally:
            for p in extras:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
