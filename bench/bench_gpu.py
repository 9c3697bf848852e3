"""CPU cost of GPU sampling: the watchdog's NVML sampler against polling ``nvidia-smi`` at the same rate.

Run (on a machine with a GPU; the device run does it, see tests/device/README.md):
``python3 bench/bench_gpu.py [--seconds 30] [--interval 1] [--out FILE]``.

Three figures, all CPU time (``time.process_time`` for this process, ``RUSAGE_CHILDREN`` for nvidia-smi):
- per sample: 100 NVML samples of every GPU back to back, and 10 ``nvidia-smi --query-gpu`` calls;
- at a rate: ``--seconds`` of sampling every ``--interval`` s, NVML first, then nvidia-smi, as a share of a core;
- at the normal rate (``gpu.interval``, 5 s): the per-sample cost divided by it.

The goal: NVML sampling at the normal rate costs at most 0.05 % of a core. Without NVML it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from watchdog.evidence.collect.context import SMI_QUERY
from watchdog.evidence.gpu.nvml import NvmlSource

NORMAL_INTERVAL = 5.0
GOAL_CORE_PERCENT = 0.05


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def smi_once() -> None:
    subprocess.run(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader"], capture_output=True,
                   check=False, timeout=30)


def at_rate(fn: object, seconds: float, interval: float) -> tuple[float, float, int]:
    """(own CPU s, children CPU s, calls) over ``seconds`` of calling fn every ``interval``."""
    assert callable(fn)
    p0, c0, n = time.process_time(), children_cpu(), 0
    end = time.monotonic() + seconds
    nxt = time.monotonic()
    while nxt < end:
        fn()
        n += 1
        nxt += interval
        time.sleep(max(0.0, nxt - time.monotonic()))
    return time.process_time() - p0, children_cpu() - c0, n


class TimedNvml:
    """pynvml with the CPU time of every nvmlDevice* call added up per function."""

    def __init__(self, nv: Any) -> None:
        self._nv = nv
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._nv, name)
        if not (callable(attr) and name.startswith("nvmlDevice")):
            return attr

        def timed(*args: Any) -> Any:
            t0 = time.process_time()
            try:
                return attr(*args)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    src = NvmlSource()
    why = src.open()
    if why:
        print(f"GPU sampling unavailable here: {why}")
        return 0
    gpus = len(src.sample())
    p0 = time.process_time()
    for _ in range(100):
        src.sample()
    nvml_per = (time.process_time() - p0) / 100
    p0, c0 = time.process_time(), children_cpu()
    for _ in range(10):
        smi_once()
    smi_per = (time.process_time() - p0 + children_cpu() - c0) / 10
    timed = TimedNvml(src._nvml)
    src._nvml = timed
    own, kids, n = at_rate(src.sample, a.seconds, a.interval)
    src._nvml = timed._nv
    nvml_rate = (own + kids) / a.seconds
    own2, kids2, n2 = at_rate(smi_once, a.seconds, a.interval)
    smi_rate = (own2 + kids2) / a.seconds
    res = {
        "gpus": gpus, "interval_s": a.interval, "seconds": a.seconds,
        "nvml_cpu_ms_per_sample": round(nvml_per * 1000, 3),
        "smi_cpu_ms_per_call": round(smi_per * 1000, 3),
        "nvml_at_rate_core_percent": round(nvml_rate * 100, 4), "nvml_samples": n,
        "smi_at_rate_core_percent": round(smi_rate * 100, 4), "smi_calls": n2,
        "smi_at_rate_parent_cpu_s": round(own2, 4), "smi_at_rate_children_cpu_s": round(kids2, 4),
        "nvml_cpu_ms_per_call_at_rate": {k: round(v / timed.calls[k] * 1000, 3) for k, v in timed.cpu.items()},
        "normal_interval_s": NORMAL_INTERVAL,
        "nvml_at_normal_core_percent": round(nvml_per / NORMAL_INTERVAL * 100, 4),
        "smi_at_normal_core_percent": round(smi_per / NORMAL_INTERVAL * 100, 4),
        # the same, from the paced run (NVML answers back-to-back calls faster than paced ones)
        "nvml_at_normal_from_rate_core_percent": round(nvml_rate * 100 * a.interval / NORMAL_INTERVAL, 4),
        "smi_at_normal_from_rate_core_percent": round(smi_rate * 100 * a.interval / NORMAL_INTERVAL, 4),
        "goal_core_percent": GOAL_CORE_PERCENT,
    }
    res["goal_met"] = max(res["nvml_at_normal_core_percent"],
                          res["nvml_at_normal_from_rate_core_percent"]) <= GOAL_CORE_PERCENT
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
