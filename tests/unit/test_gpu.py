"""GPU readings on real NVML samples from one H200 (tests/data/gpu) and the shared nvidia-smi corpus."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.facts import says
from tests.fakes import FakeGpuSource
from watchdog.core.processes import EngineProcess
from watchdog.core.roles import Role
from watchdog.evidence.gpu.nvml import GpuMonitor, gpu_availability
from watchdog.evidence.gpu.readings import (
    GpuSample,
    GpuState,
    GpuThresholds,
    attach_ranks,
    corroborate,
    read_all,
    read_gpu,
    sample_from_json,
    summary_line,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
SAMPLES = json.loads((DATA / "nvml-samples.json").read_text())


def _samples(scenario: str, index: int = 0) -> list[GpuSample]:
    return [s for s in map(sample_from_json, SAMPLES[scenario]) if s.index == index]


@pytest.mark.parametrize(("scenario", "index", "state"), [
    ("idle", 0, GpuState.IDLE),  # a context held: 0 % at 120 W
    ("matmul", 0, GpuState.WORKING),
    ("gemv", 0, GpuState.WORKING),  # memory-bound batch-1 work still draws 550-640 W
    ("spin", 0, GpuState.SPINNING),
    ("spin_wide", 0, GpuState.SPINNING),  # every SM spinning: still 123 W
    ("nccl", 0, GpuState.SPINNING),
    ("nccl_bypass", 0, GpuState.SPINNING),
    ("nccl2", 0, GpuState.SPINNING),  # NCCL's own kernel waiting for rank 1
    ("nccl2", 1, GpuState.IDLE),  # rank 1 holding back: its GPU runs nothing
])
def test_real_h200_samples(scenario: str, index: int, state: GpuState) -> None:
    r = read_gpu(_samples(scenario, index))
    assert r.state == state, r.why
    assert r.pids  # NVML named the process holding the GPU


def _smi(name: str) -> list[GpuSample]:  # the shared corpus nvidia-smi CSVs (copied)
    rows = list(csv.DictReader((DATA / name).read_text().splitlines(), skipinitialspace=True))
    return [GpuSample(float(i), 0, util=int(r["utilization.gpu"]), power_w=float(r["power.draw"]),
                      power_limit_w=700.0, sm_clock_mhz=int(r["clocks.sm"])) for i, r in enumerate(rows)]


@pytest.mark.parametrize(("name", "state"), [("smi-idle.csv", GpuState.IDLE), ("smi-healthy.csv", GpuState.WORKING),
                                             ("smi-wedged.csv", GpuState.SPINNING), ("smi-after.csv", GpuState.IDLE)])
def test_shared_nvidia_smi_samples(name: str, state: GpuState) -> None:
    assert read_gpu(_smi(name)).state == state


def test_threshold_is_relative_to_the_power_limit() -> None:
    spin = _samples("spin")
    assert read_gpu(spin).state == GpuState.SPINNING
    # the same readings on a GPU whose limit were 400 W would be 30 %: above the fraction, so working
    scaled = [GpuSample(s.t, s.index, util=s.util, power_w=s.power_w, power_limit_w=400.0) for s in spin]
    assert read_gpu(scaled).state == GpuState.WORKING


def test_too_few_or_mixed_samples_are_unknown() -> None:
    assert read_gpu(_samples("spin")[:2]).state == GpuState.UNKNOWN
    mixed = _samples("idle")[:4] + _samples("matmul")[:4]
    assert read_gpu(mixed).state == GpuState.UNKNOWN
    no_power = [GpuSample(s.t, 0, util=s.util) for s in _samples("spin")]
    assert read_gpu(no_power).state == GpuState.UNKNOWN
    with pytest.raises(ValueError):
        read_gpu([])


def test_window_ranks_and_sentences() -> None:
    samples = _samples("nccl2", 0) + _samples("nccl2", 1)
    t0, t1 = min(s.t for s in samples), max(s.t for s in samples)
    readings = read_all(samples, t0, t1)
    assert [r.index for r in readings] == [0, 1]
    assert read_all(samples, t1 + 1, t1 + 2) == []
    meta = json.loads((DATA / "run-meta.json").read_text())["scenarios"]["nccl2"]
    procs = [EngineProcess(pid, Role.WORKER, f"VLLM::Worker_TP{i}", {"TP": i}) for i, pid in enumerate(meta["pids"])]
    named = attach_ranks(readings, procs)
    assert named[0].ranks == ("VLLM::Worker_TP0",) and named[1].ranks == ("VLLM::Worker_TP1",)
    line = summary_line(named[0])
    assert says(line, "GPU 0", "VLLM::Worker_TP0", "spinning", "idle power") and not says(line, "VLLM::Worker_TP1")
    assert "agrees" in corroborate("device_wait", named[0])
    assert "idle" in corroborate("unknown", named[1])
    assert corroborate("device_wait", None) == ""
    assert "working" in corroborate("device_wait", read_gpu(_samples("matmul")))


def test_sample_json_round_trip_and_bad_input() -> None:
    s = _samples("nccl")[0]
    assert sample_from_json(s.to_json()) == s
    with pytest.raises(ValueError):
        sample_from_json({"t": 1.0})
    with pytest.raises(ValueError):
        sample_from_json({"t": 1.0, "index": 0, "util": "high"})


def test_monitor_rates_window_and_unavailable() -> None:
    now = [1000.0]
    rounds = [[GpuSample(1000.0 + i, 0, util=100, power_w=121.0, power_limit_w=700.0)] for i in range(5)]
    mon = GpuMonitor(FakeGpuSource(rounds), interval=5.0, dense_interval=0.5, dense_for=10.0, keep_seconds=8.0,
                     clock=lambda: now[0])
    assert mon.tick() == 5.0
    mon.dense(now[0])
    assert mon.tick() == 0.5
    now[0] = 1004.0
    assert mon.tick() == 0.5
    now[0] = 1011.0
    assert mon.tick() == 5.0  # dense_for passed
    assert [s.t for s in mon.window(1000.0)] == [1003.0]  # older than keep_seconds dropped
    off = GpuMonitor(FakeGpuSource([], unavailable="NVML sees no GPU"))
    assert off.start() == "NVML sees no GPU" and off.window(0) == []
    off.stop()
    assert gpu_availability(FakeGpuSource([], unavailable="no driver")) == {"available": False, "gpus": 0,
                                                                            "why": "no driver"}
    assert gpu_availability(FakeGpuSource([rounds[0]]))["gpus"] == 1


def test_thresholds_are_settable() -> None:
    assert read_gpu(_samples("spin"), GpuThresholds(spin_power_fraction=0.1)).state == GpuState.WORKING


def test_gather_and_write_gpu_evidence(tmp_path: Path) -> None:
    import socket

    from watchdog.config.gpu import GpuSection
    from watchdog.evidence.gpu.gather import gather_gpu, write_gpu_files

    samples = _samples("nccl2", 0) + _samples("nccl2", 1)
    t0, t1 = min(s.t for s in samples), max(s.t for s in samples)
    mon = GpuMonitor(FakeGpuSource([samples]), keep_seconds=1e9, clock=lambda: t1)
    mon.tick()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    meta = json.loads((DATA / "run-meta.json").read_text())["scenarios"]["nccl2"]
    procs = [EngineProcess(pid, Role.WORKER, f"VLLM::Worker_TP{i}", {"TP": i}) for i, pid in enumerate(meta["pids"])]
    ev = gather_gpu(procs, mon, GpuSection(ras_address=f"127.0.0.1:{port}", ras_timeout=1), t0, freeze=False,
                    now=t1)
    assert [r.state for r in ev.readings] == [GpuState.SPINNING, GpuState.IDLE]
    assert any("nothing listens" in p for p in ev.problems)
    names = write_gpu_files(tmp_path, ev)
    assert names == ["gpu.jsonl", "gpu.md"]
    md = (tmp_path / "gpu.md").read_text()
    assert "GPU 0 (VLLM::Worker_TP0): spinning" in md and "GPU 1 (VLLM::Worker_TP1): idle" in md
    assert len((tmp_path / "gpu.jsonl").read_text().splitlines()) == len(samples)
    off = gather_gpu(procs, None, GpuSection(ras=False), t0, freeze=True, now=t1)
    assert off.readings == () and "GPU evidence unavailable" in off.problems[0]
