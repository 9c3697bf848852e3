"""What vLLM's multi-node start needs, measured on the real two-node pair (tests/harness/two_node.py).

    flock /tmp/ew-engine.lock .venv/bin/python -m bench.two_node_start_order [--gap 20] [--out FILE]

Starts the pair twice: the worker first and the head `gap` seconds later, then the head first and the worker `gap`
seconds later; each time the seconds from the second start to the first successful generation, and whether the
first half was still running, waiting, when the second came. Needs root (namespaces, veth, sshd).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from tests.harness import engine_env, models
from tests.harness.sshnode import SshNode
from tests.harness.two_node import TwoNodeVllm


def once(pair: TwoNodeVllm, first: str, gap: float) -> dict[str, object]:
    second = "head" if first == "worker" else "worker"
    t0 = time.monotonic()
    pair.do("start", first)
    time.sleep(gap)
    waiting = [t for t in pair.pids(first) if t != "root"] if (pair.run / f"{first}.pid").exists() else []
    tail = pair.log_tail(first, 600).strip().splitlines()[-2:]
    t1 = time.monotonic()
    pair.do("start", second)
    ready = pair.wait_ready(300)
    out = {"first": first, "gap_s": gap, "first_alive_at_second_start": bool(waiting), "first_processes": waiting,
           "first_log_before_second": tail, "second_start_to_ready_s": round(ready, 1),
           "first_start_to_ready_s": round(time.monotonic() - t0, 1), "second_start_s": round(t1 - t0, 1)}
    print(json.dumps(out), flush=True)
    for role in ("head", "worker"):
        pair.do("stop", role)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gap", type=float, default=20.0)
    ap.add_argument("--out", default="bench/results/two-node-start-order.json")
    a = ap.parse_args()
    python = engine_env.engine_python()
    model = models.ensure_model(models.FAST, python)
    root = Path(tempfile.mkdtemp(prefix="ew-start-order-"))
    node = SshNode(root, f'audit_log = "{root}/node/agent.log"\n').start()
    pair = TwoNodeVllm(root, python, model, node)
    try:
        pair._spec("head")
        pair._spec("worker")
        pair.start_head_namespace()
        runs = [once(pair, "worker", a.gap), once(pair, "head", a.gap)]
    finally:
        with contextlib.suppress(Exception):
            pair.close()
        node.close()
        shutil.rmtree(root, ignore_errors=True)
    Path(a.out).write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
