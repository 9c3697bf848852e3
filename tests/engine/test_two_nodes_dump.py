"""`watchdog dump --json` per node on a real two-node vLLM (CPU, TP=2): the head in its own PID namespace, the
worker headless in its own network, PID and mount namespaces behind a real sshd (`tests/harness/two_node.py`).

1. Healthy, under load: every rank on both nodes, each named with its node; the worker node's own log tail (the
   file its agent config allows, named by the head's ``[[nodes]]`` entry) in the bundle; the clock offset; exit 0.
2. The link to the worker cut (veth down): the head's own evidence is there, the worker's is missing and said so
   ("node worker1: unreachable"), exit 1 (incomplete); the link restored before the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.load import LoadGenerator
from tests.harness.two_node import TwoNodeVllm, running_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, engine_python: Path, fast_model: Path) -> Iterator[TwoNodeVllm]:
    root = tmp_path_factory.mktemp("two-nodes-dump")
    with running_pair(root, engine_python, fast_model,
                      f'audit_log = "{root}/node/agent.log"\nlog_file = "{root}/run/worker.log"\n') as p:
        yield p


def dump(pair: TwoNodeVllm, tmp_path: Path) -> tuple[int, dict[str, object]]:
    cfg = tmp_path / "watchdog.toml"
    cfg.write_text(f'[engine]\nurl = "{pair.url}"\n[capture]\ngap = 1.0\n' + pair.node.toml()
                   + f'log_file = "{pair.run / "worker.log"}"\n')
    r = subprocess.run([*pair.head_nsenter(), sys.executable, "-m", "watchdog", "dump", "--config", str(cfg),
                        "--out", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=180,
                       check=False)
    assert r.stdout.strip(), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def test_dump_says_per_node_what_it_captured(pair: TwoNodeVllm, tmp_path: Path) -> None:
    with LoadGenerator(pair.url, pair.model_name, threads=2, duration=120):
        rc, out = dump(pair, tmp_path)
    nodes: dict[str, dict[str, object]] = out["nodes"]  # type: ignore[assignment]
    assert rc == 0 and out["complete"] is True, json.dumps(nodes, indent=1)
    local, worker = nodes["local"], nodes["worker1"]
    titles = {p["title"] for p in local["processes"]}  # type: ignore[attr-defined]
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0"} <= titles and "VLLM::Worker_TP1" not in titles
    assert [p["title"] for p in worker["processes"]] == ["VLLM::Worker_TP1"]  # type: ignore[attr-defined]
    assert local["evidence"] == worker["evidence"] == "complete"
    # one machine, one clock: the offset is only the answer's way back over ssh (0.4 s seen on a saturated box)
    assert worker["reachable"] is True and abs(float(worker["clock_offset_s"])) < 2.0  # type: ignore[arg-type]
    assert worker["log_source"] == str(pair.run / "worker.log") and int(worker["log_lines"]) > 0  # type: ignore[call-overload]
    procs: list[dict[str, object]] = out["processes"]  # type: ignore[assignment]
    assert {p["node"] for p in procs if p["title"] == "VLLM::Worker_TP1 on node worker1"} == {"worker1"}
    bundle = Path(str(out["bundle"]))
    tail = (bundle / "log-tail-worker1.txt").read_text()
    assert tail.strip() and tail.strip().splitlines()[-1] in pair.log_tail("worker", 200_000)  # the worker's own log


def test_dump_with_the_link_cut_says_the_node_is_missing(pair: TwoNodeVllm, tmp_path: Path) -> None:
    pair.node.link(False)
    try:
        rc, out = dump(pair, tmp_path)
    finally:
        pair.node.link(True)
    nodes: dict[str, dict[str, object]] = out["nodes"]  # type: ignore[assignment]
    assert rc == 1 and out["complete"] is False
    assert nodes["local"]["evidence"] == "complete"
    worker = nodes["worker1"]
    assert worker["reachable"] is False and worker["evidence"] == "missing" and worker["processes"] == []
    problems: list[str] = worker["problems"]  # type: ignore[assignment]
    assert problems and all(p.startswith("node worker1: unreachable: ") for p in problems), problems
    pair.wait_ready(60)  # the engine still serves once the link is back
