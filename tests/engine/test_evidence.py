"""Evidence against a real vLLM (CPU build, TP=2): stacks of every rank, explained; bundles from the daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.facts import clause_of, line_of, says
from tests.harness import engine_env
from tests.harness.faults import frozen
from tests.harness.load import DEFAULT_PROMPT, BackgroundRequest, LoadGenerator, calibrated_tokens, long_prompt
from tests.harness.server import VllmServer
from tests.harness.watcher import WatchdogProcess, event_time

pytestmark = pytest.mark.engine


def dump(url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "watchdog", "dump", "--url", url, "--out", str(out), "--json", *extra],
                       capture_output=True, text=True, timeout=120, check=False, start_new_session=True)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout)


def by_title(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in manifest["processes"] if p["title"]}


def functions(proc: dict[str, Any]) -> list[str]:
    return [f["function"].rsplit(".", 1)[-1] for f in proc["frames"]]


@pytest.mark.versions
def test_idle_engine(shared_vllm: VllmServer, tmp_path: Path) -> None:
    server = shared_vllm
    code, m = dump(server.url, tmp_path / "incidents")
    assert code == 0, m
    procs = by_title(m)
    assert procs["VLLM::Worker_TP0"]["class"] == "idle_reader_wait"
    assert procs["VLLM::Worker_TP1"]["class"] == "idle_reader_wait"
    assert procs["VLLM::EngineCore"]["class"] == "engine_idle"
    assert "worker_busy_loop" in functions(procs["VLLM::Worker_TP1"]) or "dequeue" in functions(
        procs["VLLM::Worker_TP1"])
    assert m["culprit"] is None
    assert m["poll_parking"]["status"] == "NOT_APPLICABLE"
    bundle = Path(m["bundle"])
    assert (bundle / "summary.md").exists() and (bundle / "metrics.txt").exists()
    assert oct(bundle.stat().st_mode & 0o777) == "0o700"
    assert m["versions"].get("vllm", "").startswith(engine_env.vllm_version())


@pytest.mark.versions
def test_stopped_worker_under_load(shared_vllm: VllmServer, tmp_path: Path) -> None:
    server = shared_vllm
    with LoadGenerator(server.url, server.model_name, threads=4, duration=120, request_timeout=200):
        server.wait_running(1, 30)
        with frozen(server.process("VLLM::Worker_TP1")):
            time.sleep(2)
            code, m = dump(server.url, tmp_path / "incidents")
    assert code == 0, m
    procs = by_title(m)
    tp1, tp0, core = procs["VLLM::Worker_TP1"], procs["VLLM::Worker_TP0"], procs["VLLM::EngineCore"]
    assert tp1["state"] == "T" and tp1["class"] == "stopped" and tp1["nonblocking"]  # captured, not skipped
    assert tp1["frames"], "the stopped process's stack was read with --nonblocking"
    assert tp0["class"] == "in_collective", tp0
    # the layers' all_reduce, or the gather of the logits at the end of the step: whichever TP1 stopped short of
    assert any(k in f for f in functions(tp0) for k in ("all_reduce", "all_gather", "gather", "broadcast")), tp0
    assert core["class"] == "engine_waiting_workers", core
    assert m["culprit"] == "Worker_TP1"
    assert m["poll_parking"]["status"] == "CONTRADICTED"
    assert m["decision"] == "stuck"


def test_stopped_engine_core_under_load(shared_vllm: VllmServer, tmp_path: Path) -> None:
    server = shared_vllm
    with LoadGenerator(server.url, server.model_name, threads=4, duration=120, request_timeout=200):
        server.wait_running(1, 30)
        with frozen(server.process("VLLM::EngineCore")):
            time.sleep(3)  # workers finish the step and park in the reader
            code, m = dump(server.url, tmp_path / "incidents")
    assert code == 0, m
    procs = by_title(m)
    assert procs["VLLM::EngineCore"]["class"] == "stopped"
    assert procs["VLLM::Worker_TP0"]["class"] == "idle_reader_wait"
    assert procs["VLLM::Worker_TP1"]["class"] == "idle_reader_wait"
    assert m["culprit"] == "EngineCore"


Watch = Callable[..., WatchdogProcess]


@pytest.mark.versions
def test_daemon_writes_exactly_one_complete_bundle_on_a_freeze(
        shared_vllm: VllmServer, watch: Watch) -> None:
    server = shared_vllm
    w = watch(server.url, suspect=5.0, window=60.0, extra="[capture]\ngap = 2.0\n")
    w.wait_for_state("idle", 60)
    with LoadGenerator(server.url, server.model_name, threads=4, duration=150, request_timeout=250):
        w.wait_for_state("working", 30)
        server.wait_running(1, 30)
        with frozen(server.process("VLLM::Worker_TP1")):
            stopped = time.time()
            # deadlines, not measures (detection latency is bench/bench_engine.py's): the reason says who decided
            event = w.wait_for_state("frozen", 60 + 30, after=stopped)
            assert "stacks confirm" in event["reason"], event  # confirmed by stacks, not by the 60 s window
            print(f"frozen {event_time(event) - stopped:.1f}s after the stop (stacks confirm; suspect 5 s)")
            # the verdict says what happened from the cause down: the stopped rank first, then who waits for it
            said = event["reason"]
            assert says(clause_of(said, "Worker_TP1"), "stopped"), said
            assert said.index("Worker_TP1") < min(said.index("Worker_TP0"), said.index("EngineCore")), said
            first = w.wait_event("evidence_captured", 60)
            time.sleep(5)  # still frozen: no second bundle for the same freeze
        w.wait_for_state("working", 60, after=event_time(event))
    captured = [e for e in w.events() if e.get("event") == "evidence_captured"]
    assert captured == [first], captured
    assert captured[0]["complete"] and captured[0]["culprit"] == "Worker_TP1"
    assert event_time(captured[0]) >= event_time(event)  # the bundle of the stack-confirmed freeze
    bundle = Path(captured[0]["bundle"])
    m = json.loads((bundle / "manifest.json").read_text())
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(by_title(m))
    assert m["capture_complete"]
    assert len(list((bundle.parent).iterdir())) == 1  # one bundle, no partial directory
    # the bundle opens with that headline and the runbook of this cause; the alert and the event carry both
    assert m["headline"].startswith("Worker_TP1") and m["runbook"] == "frozen-stopped-rank", m["headline"]
    assert (m["culprit"], m["culprit_node"]) == ("Worker_TP1", "local")
    summary = [line for line in (bundle / "summary.md").read_text().splitlines() if line.strip()]
    assert summary[1] == f"**{m['headline']}**" and summary[2] == "Runbook: runbooks/frozen-stopped-rank.md", summary
    assert (captured[0]["headline"], captured[0]["runbook"]) == (m["headline"], m["runbook"])
    # the upstream bug report of this bundle, by the real CLI: the stopped rank named, every process's deciding
    # stack, the timeline; nothing of the prompts, addresses or this machine's directories
    r = subprocess.run([sys.executable, "-m", "watchdog", "show", m["id"], "--upstream", "--config", str(w.config),
                        "--state-dir", str(w.state_dir)], capture_output=True, text=True, timeout=60, check=False,
                       start_new_session=True)
    assert r.returncode == 0, r.stderr
    report = r.stdout
    assert says(line_of(report, "- culprit:"), "Worker_TP1", "stopped"), report
    for name in ("EngineCore", "Worker_TP0 (TP 0)", "Worker_TP1 (TP 1)"):
        assert f"#### {name}\n" in report, name
    assert says(line_of(report, "#### Worker_TP1"), "TP 1") and says(line_of(report, "class **stopped**"), "state T")
    assert says(line_of(report, "- vLLM:"), m["versions"]["vllm"]) and says(line_of(report, "parallelism"), "TP=2")
    assert says(line_of(report, "-> **suspect**"), "suspect") and says(line_of(report, "-> **frozen**"), "frozen")
    secret = [DEFAULT_PROMPT, "127.0.0.1", str(w.state_dir), str(Path.home()) + "/", str(Path(sys.prefix))]
    assert not [s for s in secret if s in report], [s for s in secret if s in report]


def test_giant_prefill_step_is_suspected_then_cleared_by_the_stacks(
        vllm: Callable[..., VllmServer], slow_model: Path, watch: Watch) -> None:
    """One prefill chunk keeps the page silent for longer than the suspicion delay: sized to last about 16 s (one
    step) by timing a shorter prefill on this server first."""
    server = vllm(slow_model, max_model_len=16384, max_num_batched_tokens=16384)
    tokens = calibrated_tokens(server.url, server.model_name, 16.0, most=16384 - 16, probe=2048)
    w = watch(server.url, suspect=3.0, window=120.0, probe=1.0, extra="[capture]\ngap = 2.0\n")
    w.wait_for_state("idle", 60)
    t0 = time.monotonic()
    req = BackgroundRequest(server.url, server.model_name, long_prompt(tokens), max_tokens=1, timeout=600)
    result = req.result(timeout=600)
    took = time.monotonic() - t0
    assert result.ok, result
    assert took > 3.0 + 5, f"the step of {tokens} tokens took only {took:.1f}s"
    first = w.wait_event("evidence_checked", 30)  # the suspicion during the step, decided by the stacks
    assert first["decision"] == "working", first
    states = w.states()
    assert "suspect" in states, w.events()
    checked = [e for e in w.events() if e.get("event") == "evidence_checked"]
    assert checked and checked[0]["decision"] == "working", checked
    assert "frozen" not in states, w.events()
    assert not [e for e in w.events() if e.get("event") == "evidence_captured"]
    assert not (w.state_dir / "incidents").exists() or not list((w.state_dir / "incidents").iterdir())


def test_without_pyspy_the_bundle_says_so_and_keeps_the_rest(shared_vllm: VllmServer,
                                                             tmp_path: Path) -> None:
    server = shared_vllm
    cfg = tmp_path / "nopyspy.toml"
    cfg.write_text('[capture]\npyspy = "/nonexistent/py-spy"\n')
    code, m = dump(server.url, tmp_path / "incidents", "--config", str(cfg))
    assert code == 1, m  # capture incomplete
    assert any("py-spy was not found" in p for p in m["problems"]), m["problems"]
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(by_title(m))  # still found
    bundle = Path(m["bundle"])
    assert "vllm:num_requests_running" in (bundle / "metrics.txt").read_text()
    assert "NO" in (bundle / "summary.md").read_text()  # "capture complete: NO"
