"""A real two-node vLLM (CPU, TP=2): head in its own PID namespace, worker headless in its own network, PID and
mount namespaces beside a real sshd. Scenario: Worker_TP1 on the worker node stopped under load; `watchdog dump`
run in the head's namespace sees every rank on both nodes, names the culprit with its node, one bundle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.harness.sshnode import SshNode
from tests.harness.two_node import TwoNodeVllm


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, engine_python: Path, fast_model: Path) -> Iterator[TwoNodeVllm]:
    root = tmp_path_factory.mktemp("two-nodes")
    node = SshNode(root, f'audit_log = "{root}/node/agent.log"\nremove_shm = true\n').start()
    p = TwoNodeVllm(root, engine_python, fast_model, node)
    try:
        p.start()
        yield p
    finally:
        p.close()
        node.close()


def test_remote_rank_stopped_under_load_is_the_culprit_on_its_node(pair: TwoNodeVllm, tmp_path: Path) -> None:
    cfg = tmp_path / "watchdog.toml"
    cfg.write_text(f'[engine]\nurl = "{pair.url}"\n[capture]\ngap = 1.0\n' + pair.node.toml())
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                requests.post(f"{pair.url}/v1/completions", json={"model": pair.model_name, "prompt": "hi",
                                                                  "max_tokens": 64}, timeout=20)
            except requests.RequestException:
                time.sleep(0.2)

    loaders = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in loaders:
        t.start()
    tp1 = pair.pids("worker")["VLLM::Worker_TP1"]
    time.sleep(2)
    os.kill(tp1, signal.SIGSTOP)
    try:
        time.sleep(3)
        r = subprocess.run([*pair.head_nsenter(), sys.executable, "-m", "watchdog", "dump", "--config", str(cfg),
                            "--out", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=120,
                           check=False)
    finally:
        os.kill(tp1, signal.SIGCONT)
        stop.set()
    out = json.loads(r.stdout)
    titles = {p["title"] for p in out["processes"]}
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1 on node worker1"} <= titles, titles
    assert "VLLM::Worker_TP1" not in titles  # the head's own /proc does not see the worker's ranks
    # the culprit is named by rank (explain's name for it); the node is in the process's title beside it
    assert out["culprit"] == "Worker_TP1", out
    stopped = [p for p in out["processes"] if p["state"] in ("T", "t")]
    assert [p["title"] for p in stopped] == ["VLLM::Worker_TP1 on node worker1"], stopped
    bundle = Path(out["bundle"])
    dumps = sorted(p.name for p in (bundle / "dumps").iterdir())
    assert any("Worker_TP1 on node worker1" in d for d in dumps) and any("Worker_TP0" in d for d in dumps)
    assert "clock offset s (node worker1)" in json.dumps(out)
    print(out["culprit"], out["cross_rank"], out["poll_parking"])
