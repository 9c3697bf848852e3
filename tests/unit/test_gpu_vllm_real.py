"""The real vLLM 0.25.1 CUDA wheel on one H200 (TP=1, CUDA graphs on), watched by the real `watchdog run` at its
defaults, replayed without a GPU: the bundles, the page trace, NVML and the engine's log that the device run kept
(tests/data/gpu-vllm-0.25.1/README.md; made by scripts/device-vllm-record)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.facts import says
from tests.unit.hangs_data import load
from watchdog.core.types import Decision, State
from watchdog.evidence.collect.capture import STOPPED_NATIVE
from watchdog.evidence.explain.findings import PageWork, assess
from watchdog.evidence.explain.headline import compose
from watchdog.evidence.gpu.gather import SINGLE_RANK
from watchdog.judge.track import Thresholds
from watchdog.scrape.page import read_page
from watchdog.service.replay import replay
from watchdog.service.trace import read_trace

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu-vllm-0.25.1"
BUNDLES = DATA / "bundles"


def _page(name: str) -> PageWork:
    e = next(iter(read_page((BUNDLES / name / "metrics.txt").read_text()).engines.values()))
    return PageWork(e.running, e.waiting)


def _phases(root: Path = DATA) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "phases.jsonl").read_text().splitlines() if line.strip()]


def _at(what: str, root: Path = DATA) -> float:
    return next(p["t"] for p in _phases(root) if p["what"] == what)


@pytest.mark.parametrize(("bundle", "decision", "words"), [
    ("dump-idle", Decision.IDLE, ("idle engine", "EngineCore waits for requests", "running=0, waiting=0")),
    ("dump-load", Decision.WORKING, ("not a freeze", "EngineCore")),
    ("dump-stopped", Decision.STUCK, ("EngineCore is stopped",)),
    ("dump-spinning", Decision.STUCK, ("EngineCore waits on its own GPU",)),
    ("frozen-stopped", Decision.STUCK, ("EngineCore is stopped",)),
    ("frozen-spinning", Decision.STUCK, ("EngineCore waits on its own GPU",)),
])
def test_each_recorded_capture_reads_as_the_engine_was(bundle: str, decision: Decision, words: tuple[str, ...]) -> None:
    """Before the fix, `watchdog dump` of the healthy idle engine said "stuck", runbook frozen-all-parked."""
    cap, m = load(bundle, BUNDLES)
    f = assess(cap, work_pending=decision is not Decision.IDLE, page=_page(bundle))
    assert f.decision is decision, f.reason
    said = compose(f, cap).text
    assert says(said, *words), said
    assert m["decision"] == decision.value  # what the real watchdog wrote on the device says the same


def test_the_stopped_engine_core_has_no_native_dump_passed_off_as_one() -> None:
    native = json.loads(next((BUNDLES / "frozen-stopped" / "dumps").glob("native-*")).read_text())
    assert native == {"error": STOPPED_NATIVE}
    spinning = json.loads(next((BUNDLES / "frozen-spinning" / "dumps").glob("native-*")).read_text())
    frames = [fr["name"] for t in spinning for fr in t["frames"]]
    assert any("Synchronize" in fn for fn in frames), frames[:20]  # a running process: its CUDA wait in native


@pytest.mark.parametrize("bundle", ["frozen-stopped", "frozen-spinning"])
def test_one_rank_asks_no_flight_recorder_and_the_gpu_reading_agrees(bundle: str) -> None:
    m = json.loads((BUNDLES / bundle / "manifest.json").read_text())
    text = json.dumps(m["gpu"])
    assert SINGLE_RANK in text
    ranks = " ".join(m["gpu"]["ranks"])
    if bundle == "frozen-spinning":  # NVML: 100 % busy at idle power, the kernel that never ends
        assert says(ranks, "busy at idle power", "agrees"), ranks
    else:
        assert says(ranks, "idle", "no kernel resident"), ranks


def test_the_watchdog_saw_each_fault_frozen_within_seconds_and_the_boot_as_starting() -> None:
    """The real watchdog's events: the boot with CUDA graphs (minutes of compilation and capture) reads starting, never
    suspect or frozen; SIGSTOP and the spinning kernel each read frozen from the stacks."""
    events = [json.loads(x) for x in (DATA / "events.jsonl").read_text().splitlines() if x.strip()]
    ready = _at("first generation")
    boot = [e["to"] for e in events if e["event"] == "transition" and _wall(e) < ready]
    assert set(boot) <= {"down", "starting", "idle", "working"} and "starting" in boot, boot
    frozen = [_wall(e) for e in events if e["event"] == "transition" and e["to"] == "frozen"]
    for fault in ("SIGSTOP", "armed gpu_spin"):
        t = _at(fault)
        after = [w - t for w in frozen if w > t]
        assert after and after[0] < 20, (fault, after)  # measured 8.9 s and 8.8 s


def _wall(e: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()


def test_the_page_trace_replayed_through_the_judge_says_the_same() -> None:
    states = [t.to_state for t in replay(read_trace(DATA / "trace.jsonl"), Thresholds())]
    assert states.count(State.FROZEN) == 2, states
    before = states[:states.index(State.FROZEN)]
    assert State.STARTING in before and State.SUSPECT in before, before


def test_a_cuda_illegal_memory_access_reads_down_and_the_log_says_why() -> None:
    crash = DATA / "crash"
    events = [json.loads(x) for x in (crash / "events.jsonl").read_text().splitlines() if x.strip()]
    armed = _at("armed illegal_access; one request with repetition_penalty", crash)
    down = [_wall(e) - armed for e in events if e["event"] == "transition" and e["to"] == "down" and _wall(e) > armed]
    assert down and down[0] < 10, down  # measured 1.0 s: the server exits at once
    [opened] = [e for e in events if e["event"] == "incident_opened"]
    assert opened["kind"] == "down" and "?" not in opened["reason"]  # the page's URL, not the filter's 15 names
    assert "CUDA error: an illegal memory access was encountered" in (crash / "engine.log").read_text()
    # the daemon's own bundle of the down incident, written before anything else was done (here: observe only)
    [captured] = [e for e in events if e["event"] == "evidence_captured"]
    said = "down: the engine died: CUDA error: an illegal memory access was encountered (torch.AcceleratorError in " \
           "EngineCore)"
    assert captured["incident"] == opened["incident"] and captured["headline"] == said
    assert captured["runbook"] == "down-engine-error"
    assert [e["event"] for e in events if e["event"] != "transition"] == ["incident_opened", "evidence_captured",
                                                                          "restart_not_run"]
    bundle = crash / "bundles" / opened["incident"]
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["headline"] == said and m["state"] == "down" and m["processes"] == []
    assert (m["log_cause"]["process"], m["log_cause"]["pid"]) == ("EngineCore", 725)
    assert _wall({"time": m["created"].replace("+00:00", "Z")}) - _wall(opened) < 1.0  # measured 0.04 s
    assert m["gpu"]["readings"] and "idle" in " ".join(m["gpu"]["lines"])  # the GPU after the crash: no kernel
