"""The GPU-aware cross-rank verdict on real two-H200 tensor-parallel data (tests/data/gpu-tp2, issue 10)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tests.facts import clause_of, says
from watchdog.core.roles import ranks_of
from watchdog.evidence.explain.frame_rules import main_thread
from watchdog.evidence.explain.ranks import classify
from watchdog.evidence.gpu.culprit import RankView, gpu_culprit
from watchdog.evidence.gpu.ras_status import parse_ras
from watchdog.evidence.gpu.readings import GpuState, read_all, sample_from_json
from watchdog.evidence.stacks.parse import parse_pyspy_json

RUN = Path(__file__).resolve().parent.parent / "data" / "gpu-tp2" / "run1"
WEDGE1 = next((RUN / "wedge1" / "state" / "incidents").iterdir())


def _views(bundle: Path) -> list[RankView]:
    samples = [sample_from_json(json.loads(line)) for line in (bundle / "gpu.jsonl").read_text().splitlines()]
    wedged = json.loads((RUN / "wedge1" / "engine" / "wedged.json").read_text())["t"]
    readings = read_all(samples, wedged + 2, max(s.t for s in samples))
    views = []
    for dump in sorted((bundle / "dumps").glob("round1-*-VLLM-Worker_TP*.json")):
        pid, title = int(dump.name.split("-")[1]), "VLLM::" + dump.stem.split("-VLLM-")[1]
        ps = parse_pyspy_json(json.loads(dump.read_text()), pid=pid, title=title)
        main = main_thread(ps)
        assert main is not None
        gpu = next((r.state for r in readings if pid in r.pids), None)
        views.append(RankView(title.removeprefix("VLLM::"), ranks_of(title)["TP"], classify(ps).cls.value,
                              main.frames, gpu))
    return views


def test_real_hang_names_rank1_from_stacks_power_and_ras() -> None:
    views = _views(WEDGE1)
    assert [(v.name, v.cls, v.gpu) for v in views] == [
        ("Worker_TP0", "unknown", GpuState.SPINNING), ("Worker_TP1", "device_wait", GpuState.SPINNING)]
    ras = parse_ras((WEDGE1 / "nccl-ras.txt").read_text())
    v = gpu_culprit(views, ras)
    assert (v.culprit, v.rank) == ("Worker_TP1", 1)
    assert v.sources == ("nccl_ras", "stacks+power")
    assert says(clause_of(v.reason, "Worker_TP1"), "rank 1", "idle power", "own device"), v.reason
    assert says(clause_of(v.reason, "Worker_TP0"), "rank 0", "idle power", "launching"), v.reason


def test_stacks_and_power_alone_name_the_culprit_and_follow_the_roles() -> None:
    views = _views(WEDGE1)
    assert gpu_culprit(views).culprit == "Worker_TP1"
    swapped = [replace(v, rank=1 - (v.rank or 0), name=f"Worker_TP{1 - (v.rank or 0)}") for v in views]
    assert (gpu_culprit(swapped).culprit, gpu_culprit(swapped).rank) == ("Worker_TP0", 0)


def test_power_working_is_no_hang_in_a_kernel() -> None:
    views = [replace(v, gpu=GpuState.WORKING) for v in _views(WEDGE1)]
    assert gpu_culprit(views).culprit is None


def test_rank0_wedged_ras_names_rank0() -> None:
    ras = parse_ras((RUN / "wedge0" / "ras-driver.txt").read_text())
    v = gpu_culprit([], ras)
    assert (v.culprit, v.rank, v.sources) == ("rank 0", 0, ("nccl_ras",))
    wedge1 = parse_ras((RUN / "wedge1" / "ras-driver.txt").read_text())
    assert gpu_culprit([], wedge1).rank == 1


def test_healthy_run_never_confirmed_a_freeze() -> None:
    events = [json.loads(line) for line in (RUN / "healthy" / "state" / "events.jsonl").read_text().splitlines()]
    assert events and events[0]["to"] == "working"
    assert not [e for e in events if e.get("to") == "frozen" or e["event"] == "incident_opened"]
    assert not (RUN / "healthy" / "state" / "incidents").exists()
