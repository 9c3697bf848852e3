"""A real HAProxy in front of two real vLLMs (CPU, TP=1), each watched by its own `watchdog run`: one proxy checks
each watchdog's /readyz, the other vLLM's own /health, both over the same engines, the same client load, the same
freeze (tests/harness/lb_scenario.py). The figures (seconds to leave rotation, requests failed or hung) go to
bench/bench_probes.py; here only what must always hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import lb_scenario

pytestmark = pytest.mark.engine


@pytest.mark.timeout(1500)
def test_haproxy_on_readyz_takes_a_frozen_engine_out_and_back_health_does_not(
        engine_python: Path, fast_model: Path, tmp_path: Path) -> None:
    report = lb_scenario.run(tmp_path, engine_python, fast_model)
    print(json.dumps(report, indent=1))
    readyz, health = report["proxies"]["via_readyz"], report["proxies"]["via_health"]
    t = report["timeline_s"]
    assert 0 < t["frozen"] < t["restart_started"] < t["engine_ended_not_before"] < t["recovered"]
    # /readyz: out of rotation while frozen, before anything ended the engine; nothing sent to it after; back after
    # the watchdog's restart and first generation
    assert readyz["out_while_frozen"], readyz
    assert readyz["out_of_rotation_after_frozen_s"] is not None and readyz["out_of_rotation_after_frozen_s"] > 0
    assert readyz["sent_to_frozen_engine_after_out"] == 0, readyz
    assert readyz["back_in_rotation_after_recovered_s"] is not None and readyz["back_in_rotation_after_recovered_s"] > 0
    # /health: the frozen engine answers 200 the whole time; only the restart (the engine gone) takes it out
    assert not health["out_while_frozen"], health
    assert health["status_until_engine_ended"] == "UP", health
    assert health["out_of_rotation_after_fault_s"] > t["engine_ended_not_before"], health
