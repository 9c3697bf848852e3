"""The lost wake-up and diverged ranks across two nodes, the deployment's topology, on vLLM 0.25.1 (before the fix),
made inside the real engine (tests/harness/inject) and judged by the real `watchdog run` in the head's namespaces
at its defaults (plus the [[nodes]] entry that reaches the worker's agent):

1. lost wake-up on the head, one request after idle: only the head's Worker_TP0 is a local reader of the ring; the
   worker node's Worker_TP1 gets the step over ZMQ, runs it and waits in its collective for TP0. `frozen`,
   poll-parking SUPPORTED, Worker_TP0 named as the parked rank, Worker_TP1 not blamed (without the ring, the rules
   read TP0's reader as "it left or skipped the collective": the rival hypothesis);
2. diverged ranks: Worker_TP1 on the worker node enters a barrier Worker_TP0 never joins: `frozen` as `diverged`,
   poll-parking CONTRADICTED. Last: a divergence never heals.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import engine_env, models
from tests.harness.inject import injected_env
from tests.harness.load import BackgroundRequest, LoadGenerator
from tests.harness.two_node import HeadWatchdog, TwoNodeVllm, running_pair
from tests.harness.watcher import event_time

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodeVllm]:
    python = engine_env.engine_python(version=engine_env.BEFORE_FIX_VERSION)
    model = models.ensure_model(models.FAST, python)
    root = tmp_path_factory.mktemp("lost-wakeup-two-nodes")
    flag = root / "fault"
    flag.write_text("")
    env = {k: v for k, v in injected_env(flag).items() if v is not None}
    with running_pair(root, python, model, f'audit_log = "{root}/node/agent.log"\n', env) as p:
        p.flag = flag  # type: ignore[attr-defined]
        yield p
        flag.write_text("")


def fault(pair: TwoNodeVllm, mode: str) -> None:
    pair.flag.write_text(mode)  # type: ignore[attr-defined]
    time.sleep(0.5)


@pytest.fixture
def head(pair: TwoNodeVllm, tmp_path: Path) -> Iterator[HeadWatchdog]:
    config = f'[engine]\nurl = "{pair.url}"\n' + pair.node.toml()
    w = HeadWatchdog(pair.url, pair.head_nsenter(), tmp_path / "watchdog", config).start()
    try:
        yield w
    finally:
        fault(pair, "")
        w.stop()


def manifest(w: HeadWatchdog, after: float) -> dict[str, Any]:
    ev = w.wait_for("evidence_captured", lambda: next(
        (e for e in w.events() if e["event"] == "evidence_captured" and event_time(e) >= after), None), 90)
    m: dict[str, Any] = json.loads((Path(ev["bundle"]) / "manifest.json").read_text())
    return m


def test_lost_wakeup_on_the_head_names_the_parked_rank_not_its_peer(pair: TwoNodeVllm, head: HeadWatchdog) -> None:
    w = head
    w.wait_for_state("idle", 120)
    fault(pair, "lost_wakeup")
    time.sleep(3.0)
    began = time.time()
    request = BackgroundRequest(pair.url, pair.model_name, "after idle", max_tokens=4, timeout=300)
    frozen = w.wait_for_state("frozen", 150, after=began)
    m = manifest(w, event_time(frozen) - 30)
    assert m["stuck_kind"] == "lost_wakeup", (m["decision"], m["decision_reason"], m["cross_rank"])
    assert m["poll_parking"]["status"] == "SUPPORTED", m["poll_parking"]
    assert m["culprit"] == "Worker_TP0", (m["culprit"], m["cross_rank"])
    assert m["headline"].startswith("lost wake-up: Worker_TP0 is parked in its reader with block"), m["headline"]
    assert "Worker_TP1 on node worker1 took the step and waits in" in m["headline"], m["headline"]
    assert ", not by Worker_TP0" in m["ring"] or "read by none of its 1 local reader" in m["ring"], m["ring"]
    assert m["known_hang"] is not None and m["known_hang"]["id"] == "lost_wakeup", m["known_hang"]
    print(f"two nodes, lost wake-up (0.25.1): frozen {event_time(frozen) - began:.1f} s after the request; "
          f"{m['headline']}; ring: {m['ring']}")
    fault(pair, "")  # the dropped notify goes out late: TP0 wakes and the step completes
    assert request.result(120).ok


def test_diverged_ranks_across_nodes_are_frozen_as_diverged(pair: TwoNodeVllm, head: HeadWatchdog) -> None:
    """Last in the module: a divergence never heals (the pair is ended after it)."""
    w = head
    w.wait_for_state("idle", 120)
    load = LoadGenerator(pair.url, pair.model_name, threads=2, max_tokens=(64, 64), request_timeout=60,
                         duration=None).start()
    try:
        w.wait_for_state("working", 60)
        fault(pair, "diverge")
        began = time.time()
        frozen = w.wait_for_state("frozen", 150, after=began)
        m = manifest(w, event_time(frozen) - 30)
    finally:
        load.stop(timeout=1.0)
    assert "diverge: VLLM::Worker_TP1 enters a barrier" in pair.log_tail("worker")
    assert m["stuck_kind"] == "diverged", (m["decision"], m["decision_reason"], m["cross_rank"])
    assert m["poll_parking"]["status"] == "CONTRADICTED", m["poll_parking"]
    assert m["headline"].startswith("the ranks diverged: "), m["headline"]
    assert "Worker_TP1 on node worker1 waits in barrier" in m["headline"], m["headline"]
    print(f"two nodes, diverged (0.25.1): frozen {event_time(frozen) - began:.1f} s after the fault; "
          f"{m['headline']}; ring: {m['ring']}")
