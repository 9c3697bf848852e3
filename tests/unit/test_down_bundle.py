"""A down incident's bundle: the error that ended the engine, read from its log, in the bundle and its headline.

Replayed on the real CUDA crash recorded on the H200 (`tests/data/gpu-vllm-0.25.1/crash/engine.log`: vLLM 0.25.1,
the injected illegal memory access) through the real bundle writer, and driven through the responder with fakes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
from pathlib import Path

import pytest

from tests.unit.test_respond import Harness, config
from watchdog.config.load import Config
from watchdog.core.runbooks import Runbook
from watchdog.core.types import State
from watchdog.evidence.bundle.investigate import Investigator
from watchdog.evidence.explain.log_cause import cause_of, down_headline
from watchdog.scrape.engine_http import EngineHTTP

CRASH = Path(__file__).resolve().parents[1] / "data" / "gpu-vllm-0.25.1" / "crash"
CUDA = "CUDA error: an illegal memory access was encountered"


def test_the_real_cuda_crash_is_read_from_the_engine_log() -> None:
    c = cause_of((CRASH / "engine.log").read_text(errors="replace"))
    assert c is not None and not c.consequence
    assert (c.error, c.exception, c.process, c.pid, c.kind) == (CUDA, "torch.AcceleratorError", "EngineCore", 725,
                                                                "cuda")
    text, runbook = down_headline("nothing listening", c, log_read=True)
    assert text == f"down: the engine died: {CUDA} (torch.AcceleratorError in EngineCore)"
    assert runbook is Runbook.DOWN_ENGINE_ERROR


def test_only_the_last_life_counts_and_its_first_cause_wins() -> None:
    log = "\n".join([
        "(EngineCore pid=10) ERROR 12-03 10:00:00 [core.py:1] RuntimeError: an older crash",
        "(APIServer pid=9) INFO 12-03 10:01:00 [api_server.py:1] vLLM API server version 0.25.1",
        "2026-12-03T10:02:00+0000 node1 vllm[20]: (Worker_TP1 pid=22) ERROR 12-03 10:02:00 [w.py:1] "
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "(EngineCore pid=21) RuntimeError: shutdown failed after the worker died",
        "(APIServer pid=20) vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    ])
    c = cause_of(log)
    assert c is not None
    assert (c.process, c.pid, c.exception, c.kind) == ("Worker_TP1", 22, "torch.OutOfMemoryError", "out_of_memory")
    assert c.error.startswith("CUDA out of memory") and c.line == 3


def test_a_consequence_alone_is_said_as_such_and_no_error_is_no_cause() -> None:
    c = cause_of("(APIServer pid=5) vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    assert c is not None and c.consequence
    text, runbook = down_headline("nothing listening at http://h:8000/metrics/", c, True)
    assert text == ("down: the engine is dead: EngineCore encountered an issue. (vllm.v1.engine.exceptions."
                    "EngineDeadError in APIServer); its cause is not in the log read (scrolled out, or printed "
                    "elsewhere)")
    assert runbook is Runbook.DOWN_API
    assert cause_of("INFO all good\nINFO: Shutting down\n") is None
    assert down_headline("refused", None, True)[0] == "down: refused; the engine log read shows no error"
    assert "no engine log configured" in down_headline("refused", None, False)[0]
    seg = cause_of("(EngineCore pid=7) Fatal Python error: Segmentation fault\n")
    assert seg is not None and (seg.error, seg.kind, seg.exception) == ("Segmentation fault", "crash", "")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again on return: connection refused


def test_the_recorded_crash_replayed_through_the_real_bundle_writer(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    shutil.copy(CRASH / "engine.log", log)
    opened = next(json.loads(line) for line in (CRASH / "events.jsonl").read_text().splitlines()
                  if json.loads(line)["event"] == "incident_opened")
    base = Config()
    cfg = dataclasses.replace(base, capture=dataclasses.replace(base.capture, log_file=str(log)),
                              state=dataclasses.replace(base.state, dir=str(tmp_path / "state")))
    http = EngineHTTP(f"http://127.0.0.1:{_closed_port()}", cfg.scrape.limits())
    try:
        inv = Investigator(cfg, http, survivors=list)  # the server and its engine had exited: nothing left
        evidence = inv.investigate(None, "0", down=True)
        assert evidence.capture.processes == () and evidence.capture.rounds == ()
        bundle = inv.write(opened["incident"], "0", "down", opened["reason"], evidence)
    finally:
        http.close()
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["state"] == "down" and m["id"] == opened["incident"] == bundle.name
    assert m["headline"] == f"down: the engine died: {CUDA} (torch.AcceleratorError in EngineCore)"
    assert m["runbook"] == "down-engine-error" and m["runbook_link"] == "runbooks/down-engine-error.md"
    assert m["log_cause"]["error"] == CUDA and m["log_cause"]["pid"] == 725
    recorded = json.loads((CRASH / "bundles" / opened["incident"] / "manifest.json").read_text())
    assert (m["headline"], m["runbook"], m["log_cause"]) == (recorded["headline"], recorded["runbook"],
                                                             recorded["log_cause"])  # what the device's daemon wrote
    tail = (bundle / "log-tail.txt").read_text().splitlines()
    assert CUDA in tail[m["log_cause"]["line"] - 1]  # the line the manifest names, in the tail the bundle holds
    summary = (bundle / "summary.md").read_text()
    assert summary.splitlines()[2] == f"**{m['headline']}**"
    assert f"the engine log says: `torch.AcceleratorError: {CUDA}` (EngineCore, line" in summary
    assert "no engine process found" not in summary  # nothing left to find is not a capture problem


@pytest.fixture
def bundled(tmp_path: Path) -> tuple[Harness, list[tuple[str, str, str]]]:
    asked: list[tuple[str, str, str]] = []
    h = Harness(tmp_path, config())
    h.r.bundle = lambda inc: asked.append((inc.engine, inc.id, inc.reason))
    return h, asked


def test_a_down_incident_waits_for_its_bundle_then_restarts(bundled: tuple[Harness, list[tuple[str, str, str]]],
                                                            ) -> None:
    h, asked = bundled
    h.step(State.DOWN, since_ago=11, reason="nothing listening")
    inc = h.r.memory.incident
    assert inc is not None and inc.phase == "evidence" and asked == [("0", inc.id, "nothing listening")]
    h.step(State.DOWN, since_ago=12)
    assert h.recovery.jobs == [] and h.sent() == ["engine_down"]  # the log is read before a restart writes over it
    # a check's stacks (not final), or another incident's bundle, do not end the wait; the stacks never hold it
    h.r.evidence("0", "working", None, {"headline": "Worker is model_forward"}, final=False, incident=inc.id)
    h.r.evidence("0", "working", "/x/old", {"headline": "old"}, final=True, incident="another")
    h.step(State.DOWN, since_ago=13)
    assert h.recovery.jobs == []
    said = f"down: the engine died: {CUDA} (torch.AcceleratorError in EngineCore)"
    h.r.evidence("0", "working", f"/x/{inc.id}", {"headline": said, "runbook": "down-engine-error"}, incident=inc.id)
    h.step(State.DOWN, since_ago=14)
    assert h.sent() == ["engine_down", "evidence_captured", "restart_started"]
    assert h.alerts[1].summary == said and h.alerts[1].runbook == "runbooks/down-engine-error.md"
    assert h.r.status(h.clock.wall)["incident"]["bundle"] == f"/x/{inc.id}" and inc.evidence is None


def test_a_down_bundle_that_never_comes_delays_the_restart_by_the_evidence_timeout_only(
        bundled: tuple[Harness, list[tuple[str, str, str]]]) -> None:
    h, _ = bundled
    h.step(State.DOWN, since_ago=11)
    h.step(State.DOWN, since_ago=40, advance=30)
    assert h.recovery.jobs == []
    h.step(State.DOWN, since_ago=72, advance=31)  # past evidence_timeout (60 s)
    assert h.sent() == ["engine_down", "restart_started"]


def test_without_capture_a_down_engine_is_restarted_at_once(tmp_path: Path) -> None:
    cfg = config()
    cfg = dataclasses.replace(cfg, capture=dataclasses.replace(cfg.capture, enabled=False))
    asked: list[tuple[str, str, str]] = []
    h = Harness(tmp_path, cfg)
    h.r.bundle = lambda *a: asked.append(a)
    h.step(State.DOWN, since_ago=11)
    assert asked == [] and h.sent() == ["engine_down", "restart_started"]
