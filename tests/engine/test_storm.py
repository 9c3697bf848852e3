"""A storm of faults against a real vLLM (CPU build, TP=2) under load, watched by the real `watchdog run`: after
every fault and at the end, nothing lost, nothing doubled, the state directory bounded (`tests/harness/storm.py`).

The faults' order comes from a seed the test prints; ``WATCHDOG_STORM_SEED`` replays one,
``WATCHDOG_STORM_SECONDS`` sets how long faults are started (300 here; `bench/bench_storm.py` runs the hour),
``WATCHDOG_STORM_FAULTS`` (names, comma-separated) which faults are drawn from (all of them here)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.harness.storm import Storm

pytestmark = pytest.mark.engine


def test_a_storm_of_faults_loses_nothing(engine_python: Path, fast_model: Path, tmp_path: Path) -> None:
    seed = int(os.environ.get("WATCHDOG_STORM_SEED") or random.SystemRandom().randrange(1 << 31))
    seconds = float(os.environ.get("WATCHDOG_STORM_SECONDS") or 300)
    print(f"storm seed {seed} (WATCHDOG_STORM_SEED={seed} replays it), {seconds:.0f}s of faults")
    with Storm(engine_python, fast_model, tmp_path, seed) as storm:
        storm.run(seconds, [n for n in os.environ.get("WATCHDOG_STORM_FAULTS", "").split(",") if n] or None)
        final = storm.check()
        report = storm.report()
    (tmp_path / "storm-report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    assert not report["problems"] and not final, (report["problems"], final, report["runs"])
    assert report["faults"] >= 3, report
    assert report["restarts"] >= 2 and report["alerts_received"] >= 5, report
    # flat over the longest life of the watchdog (between two kills): a bound, not a timing
    assert report["fd_growth"] <= 8 and report["thread_growth"] <= 4, report
    assert report["rss_growth_bytes"] <= 32 * 1024 * 1024, report
    assert report["max_pass_gap_s"] <= 10.0 + 5.0, report
