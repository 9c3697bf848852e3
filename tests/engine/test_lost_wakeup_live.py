"""The hang this product exists for, made inside the real vLLM 0.25.1 (CPU build, TP=2), the release before vLLM's
fix (#45224, in 0.27.0), and told apart by the real `watchdog run` at its defaults:

1. a lost wake-up after idle: EngineCore's notify dropped (the block written to the ring as usual), one request
   after the engine idled: the page keeps its idle gauges, the probe finds the stuck request; `frozen`, poll-parking
   SUPPORTED, the ring showing the block written and unread, no culprit, the known hang #45224 named;
2. the same under load, the write slowed past the readers' 1 s busy spin (as a long step at high concurrency does):
   the page holds running > 0; the same verdict;
3. diverged ranks: Worker_TP1 enters a barrier Worker_TP0 never joins, once: `frozen` as `diverged`, poll-parking
   CONTRADICTED, the ring read to the last block.

One 0.25.1 server serves the three (the injection's lost wake-up heals once lifted: the dropped notify is sent
late). The divergence never heals: it runs last, and the server is stopped after it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.harness import engine_env, models
from tests.harness.inject import Injected, injected_vllm
from tests.harness.load import BackgroundRequest, LoadGenerator
from tests.harness.watcher import WatchdogProcess, event_time

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def before_fix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Injected]:
    """vLLM 0.25.1 with the injection loaded (inert until the flag file names a fault)."""
    python = engine_env.engine_python(version=engine_env.BEFORE_FIX_VERSION)
    model = models.ensure_model(models.FAST, python)
    with injected_vllm(python, model, tmp_path_factory.mktemp("lost-wakeup"), "vllm-0.25.1-injected") as inj:
        assert "watchdog_inject: patched vllm.distributed" in inj.server.log_tail(400)
        yield inj


@pytest.fixture
def defaults(before_fix: Injected, tmp_path: Path) -> Iterator[WatchdogProcess]:
    """The real `watchdog run` with no setting changed: only the engine's URL."""
    w = WatchdogProcess(before_fix.server.url, tmp_path / "watchdog", f'[engine]\nurl = "{before_fix.server.url}"\n')
    w.start()
    try:
        yield w
    finally:
        before_fix.fault("")
        w.stop()


def bundle(w: WatchdogProcess, after: float) -> dict[str, Any]:
    captured = next((e for e in w.events() if e["event"] == "evidence_captured" and event_time(e) >= after), None)
    deadline = time.monotonic() + 60
    while captured is None and time.monotonic() < deadline:
        time.sleep(0.3)
        captured = next((e for e in w.events() if e["event"] == "evidence_captured" and event_time(e) >= after), None)
    assert captured is not None, [e["event"] for e in w.events()]
    m: dict[str, Any] = json.loads((Path(captured["bundle"]) / "manifest.json").read_text())
    m["_dir"] = captured["bundle"]
    return m


def healed(inj: Injected, w: WatchdogProcess, frozen: dict[str, Any], *reqs: BackgroundRequest) -> None:
    """The fault lifted: the dropped notify goes out late, the parked readers wake, the requests complete."""
    inj.fault("")
    for r in reqs:
        assert r.result(120).ok
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if any(e.get("from") == "frozen" and event_time(e) >= event_time(frozen) for e in w.transitions()):
            return
        time.sleep(0.3)
    raise AssertionError(f"still frozen after the fault was lifted: {w.states()}")


def assert_lost_wakeup(m: dict[str, Any], parked: int) -> None:
    assert m["stuck_kind"] == "lost_wakeup", (m["decision"], m["decision_reason"])
    assert m["poll_parking"]["status"] == "SUPPORTED", m["poll_parking"]
    assert m["headline"].startswith("lost wake-up: "), m["headline"]
    assert "written for them and never read" in m["headline"] if parked > 1 else "written for it" in m["headline"]
    assert m["culprit"] is None, (m["culprit"], m["cross_rank"])  # nobody failed to do its part
    assert "written, read by none" in m["ring"] or ", not by Worker_TP" in m["ring"], m["ring"]
    assert m["known_hang"] is not None and m["known_hang"]["id"] == "lost_wakeup", m["known_hang"]
    assert "0.27.0" in m["headline"] and "upgrade" in m["headline"], m["headline"]
    rings = json.loads((Path(m["_dir"]) / "ring.json").read_text())
    assert any(not r["error"] and any(b["unread_by"] for b in r["blocks"]) for r in rings), rings


def test_lost_wakeup_after_idle_is_frozen_with_poll_parking_supported(before_fix: Injected,
                                                                      defaults: WatchdogProcess) -> None:
    w, server = defaults, before_fix.server
    w.wait_for_state("idle", 90)
    before_fix.fault("lost_wakeup")
    time.sleep(3.0)  # idle past the readers' 1 s busy spin: they poll their notify socket
    began = time.time()
    request = BackgroundRequest(server.url, server.model_name, "after idle", max_tokens=4, timeout=300)
    frozen = w.wait_for_state("frozen", 120, after=began)
    running, waiting = before_fix.page()
    assert (running, waiting) == (0.0, 0.0), "the page was expected to hold its idle gauges"
    assert not request.done()
    m = bundle(w, event_time(frozen) - 30)
    assert_lost_wakeup(m, parked=2)
    print(f"lost wake-up after idle (0.25.1): frozen {event_time(frozen) - began:.1f} s after the request; "
          f"page running={running:g} waiting={waiting:g}; {m['headline']}; ring: {m['ring']}")
    healed(before_fix, w, frozen, request)


def test_lost_wakeup_under_load_is_frozen_with_poll_parking_supported(before_fix: Injected,
                                                                      defaults: WatchdogProcess) -> None:
    w, server = defaults, before_fix.server
    w.wait_for_state("idle", 90)
    load = LoadGenerator(server.url, server.model_name, threads=2, max_tokens=(64, 64), request_timeout=300,
                         duration=None).start()
    try:
        w.wait_for_state("working", 60)
        before_fix.fault("lost_wakeup_slow")
        began = time.time()
        frozen = w.wait_for_state("frozen", 120, after=began)
        running, _ = before_fix.page()
        m = bundle(w, event_time(frozen) - 30)
        assert_lost_wakeup(m, parked=2)
        print(f"lost wake-up under load (0.25.1): frozen {event_time(frozen) - began:.1f} s after the fault; page "
              f"running={running:g}; {m['headline']}")
        assert running > 0
    finally:
        before_fix.fault("")  # before the load stops: its requests complete once the readers wake
        load.stop()
    healed(before_fix, w, frozen)


def test_diverged_ranks_are_frozen_as_diverged(before_fix: Injected, defaults: WatchdogProcess) -> None:
    """Last in the module: a divergence never heals (the server is stopped after it)."""
    w, server = defaults, before_fix.server
    w.wait_for_state("idle", 90)
    load = LoadGenerator(server.url, server.model_name, threads=2, max_tokens=(64, 64), request_timeout=60,
                         duration=None).start()
    try:
        w.wait_for_state("working", 60)
        before_fix.fault("diverge")
        began = time.time()
        frozen = w.wait_for_state("frozen", 120, after=began)
        m = bundle(w, event_time(frozen) - 30)
    finally:
        load.stop(timeout=1.0)
    assert "diverge: VLLM::Worker_TP1 enters a barrier" in server.log_tail(3000)
    assert m["stuck_kind"] == "diverged", (m["decision"], m["decision_reason"])
    assert m["poll_parking"]["status"] == "CONTRADICTED", m["poll_parking"]
    assert m["headline"].startswith("the ranks diverged: "), m["headline"]
    assert "Worker_TP1 waits in barrier" in m["headline"], m["headline"]
    assert m["runbook"] == "frozen-ranks-diverged", m["runbook"]
    assert m["known_hang"] is None or m["known_hang"]["id"] != "lost_wakeup", m["known_hang"]
    print(f"diverged (0.25.1): frozen {event_time(frozen) - began:.1f} s after the fault; {m['headline']}; "
          f"ring: {m['ring']}")
    with pytest.raises(requests.RequestException):
        requests.post(f"{server.url}/v1/completions", json={"model": server.model_name, "prompt": "x",
                                                             "max_tokens": 1}, timeout=3)
