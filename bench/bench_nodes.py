"""Many nodes behind one head (`tests/harness/cluster.py`: each node its own network, PID and mount namespaces, a
real sshd and the real agent, stand-in ranks titled VLLM::Worker_TP<n> parked in a ZMQ poll), the real daemon
(`watchdog run`) in the head's own PID namespace against the fake engine page, at default capture settings.

    .venv/bin/python bench/bench_nodes.py [--grid 1,2,4,8x1,4,8] [--soak-minutes 30] [--out bench/results/nodes.json]

1. Suspicion -> stacks of every rank on disk, per (nodes x ranks): one rank on the last node SIGSTOPped, work
   pending and no token moving; from the daemon's ``suspect`` event to the mtime of the bundle's manifest (written
   last) holding every rank's dumps. Reported with its ratio to the 1 x 1 run of the same invocation.
2. Steady state at the largest size (``--soak-minutes``; ``--soak-scrape``: the scrape interval, by default the
   product's 1 s): the engine idle, every node's liveness stream up; every 10 s the CPU seconds (utime+stime,
   reaped children included) and RSS of the head (the daemon and its ssh children) and of each node's agent side
   (its sshd and everything under it: the session the head's connection holds, the liveness process, short calls).
   Against, in the same window, a naive head poller: a GET of /metrics and a full prometheus_client parse at 1 Hz
   (bench_engine's NAIVE).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_engine import NAIVE  # noqa: E402
from bench.bench_two_nodes import TreeCpu, pct, sshd_listener  # noqa: E402
from tests.fakes import EngineModel, fake_engine  # noqa: E402
from tests.harness.cluster import Cluster  # noqa: E402
from tests.harness.two_node import HeadWatchdog  # noqa: E402
from tests.harness.watcher import event_time  # noqa: E402


def config(scrape: float) -> str:
    return (f"[scrape]\ninterval = {scrape}\n[probe]\ninterval = 600.0\nretry = 2.0\ntimeout = 30.0\n"
            "[state]\ntrace_max_bytes = 0\n")


CONFIG = config(0.5)  # the capture runs: a suspicion sooner, the stacks' time the same


def rss(pid: int) -> int:
    """Bytes resident of a process and everything under it."""
    total = 0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
    return total


def bundle_manifest(incidents: Path) -> Path | None:
    """The first incident bundle's manifest, once the bundle is in place (written in a dot-folder, then renamed)."""
    if not incidents.is_dir():
        return None
    return next((m for m in sorted(incidents.glob("*/manifest.json")) if not m.parent.name.startswith(".")), None)


def seen(w: HeadWatchdog, cluster: Cluster, timeout: float = 90) -> None:
    w.wait_for("every node seen with its ranks", lambda: {
        e["node"] for e in w.events() if e["event"] == "node_state" and e["state"] == "ok"} == {
        n.name for n in cluster.nodes}, timeout)


def capture(nodes: int, ranks: int, root: Path) -> dict[str, Any]:
    began = time.monotonic()
    with Cluster(root / f"c{nodes}x{ranks}", nodes, ranks) as cluster, \
            fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        w = HeadWatchdog(url, cluster.head_nsenter(), root / f"s{nodes}x{ranks}", CONFIG + cluster.toml()).start()
        try:
            seen(w, cluster)
            culprit = cluster.rank(nodes * ranks - 1)
            culprit.stop()
            stopped = time.time()
            with model.lock:
                model.running = 3
            suspect = w.wait_for_state("suspect", 60, after=stopped)
            manifest = w.wait_for("the bundle", lambda: bundle_manifest(w.state_dir / "incidents"), 90)
            m = json.loads(manifest.read_text())
            dumped = sum(n["dumps"]["ok"] for name, n in m["nodes"].items() if name != "local")
            row = {"nodes": nodes, "ranks_per_node": ranks, "ranks": nodes * ranks,
                   "suspect_to_bundle_s": round(manifest.stat().st_mtime - event_time(suspect), 2),
                   "stop_to_bundle_s": round(manifest.stat().st_mtime - stopped, 2),
                   "dumps_ok": dumped, "dumps_expected": 2 * nodes * ranks, "culprit": m["culprit"],
                   "culprit_node": m["culprit_node"], "harness_seconds": 0.0}
        finally:
            with contextlib.suppress(Exception):
                culprit.cont()
            w.stop()
    row["harness_seconds"] = round(time.monotonic() - began, 1)
    print(json.dumps(row), flush=True)
    return row


def soak(nodes: int, ranks: int, minutes: float, root: Path, scrape: float) -> dict[str, Any]:
    with Cluster(root / "soak", nodes, ranks) as cluster, fake_engine(EngineModel(gen=10, prompt=10)) as (url, _):
        w = HeadWatchdog(url, cluster.head_nsenter(), root / "soak-state", config(scrape) + cluster.toml()).start()
        naive = subprocess.Popen([sys.executable, "-c", NAIVE, url], start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            seen(w, cluster)
            time.sleep(20)  # the streams settle
            head = psutil.Process(w.pid)
            agents = {n.name: sshd_listener(n) for n in cluster.nodes}
            trees = {"head": TreeCpu(head.pid), "naive_head": TreeCpu(naive.pid),
                     **{f"agent {k}": TreeCpu(v) for k, v in agents.items()}}
            samples = []
            end = time.monotonic() + minutes * 60
            while time.monotonic() < end:
                samples.append({"t": round(time.monotonic() - trees["head"].start, 1), "head_rss": rss(head.pid),
                                **{f"rss {k}": rss(v) for k, v in agents.items()}})
                time.sleep(10)
            used = {k: t.seconds()[0] for k, t in trees.items()}
            wall = time.monotonic() - trees["head"].start
            states = sorted({e.get("to") or e.get("state") for e in w.events()
                             if e["event"] in ("transition", "node_state")} - {None})
        finally:
            os.killpg(naive.pid, signal.SIGKILL)
            naive.wait(10)
            w.stop()
    agent_pct = [pct(used[f"agent {n}"], wall) for n in agents]
    first, last = samples[0], samples[-1]
    return {
        "nodes": nodes, "ranks_per_node": ranks, "scrape_interval_s": scrape, "seconds": round(wall, 1),
        "samples": len(samples),
        "head_percent_of_a_core": pct(used["head"], wall),
        "naive_head_percent_of_a_core": pct(used["naive_head"], wall),
        "head_ratio_to_naive": round(used["head"] / max(used["naive_head"], 1e-9), 3),
        "agent_percent_of_a_core_each": {"min": min(agent_pct), "max": max(agent_pct),
                                         "mean": round(sum(agent_pct) / len(agent_pct), 3)},
        "head_rss_mb": {"first": round(first["head_rss"] / 2**20, 1), "last": round(last["head_rss"] / 2**20, 1),
                        "max": round(max(s["head_rss"] for s in samples) / 2**20, 1)},
        "agent_rss_mb_growth_max": round(max(last[f"rss {n}"] - first[f"rss {n}"] for n in agents) / 2**20, 2),
        "agent_rss_mb_last_max": round(max(last[f"rss {n}"] for n in agents) / 2**20, 1),
        "states_seen": states, "goal_head_0.5_percent_met": pct(used["head"], wall) <= 0.5,
        "rss_samples": samples[:: max(1, len(samples) // 30)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="1,2,4,8x1,4,8", help="NODES,...xRANKS,...")
    ap.add_argument("--soak-minutes", type=float, default=0.0)
    ap.add_argument("--soak-scrape", type=float, default=1.0, help="[scrape] interval of the soak (default: the "
                                                                   "product's)")
    ap.add_argument("--out", default="bench/results/nodes.json")
    a = ap.parse_args()
    node_counts, rank_counts = ([int(x) for x in part.split(",")] for part in a.grid.split("x"))
    root = Path(tempfile.mkdtemp(prefix="ew-nodes-"))
    out: dict[str, Any] = {"cpus": os.cpu_count(), "load_average_before": os.getloadavg(), "capture": []}
    for n in node_counts:
        for r in rank_counts:
            out["capture"].append(capture(n, r, root))
    base = next((row for row in out["capture"] if row["ranks"] == 1), None)
    for row in out["capture"]:
        if base is not None:
            row["ratio_to_1x1"] = round(row["suspect_to_bundle_s"] / max(base["suspect_to_bundle_s"], 1e-9), 2)
    if a.soak_minutes > 0:
        out["soak"] = soak(max(node_counts), max(rank_counts), a.soak_minutes, root, a.soak_scrape)
        print(json.dumps({k: v for k, v in out["soak"].items() if k != "rss_samples"}), flush=True)
    out["load_average_after"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"written {a.out}")


if __name__ == "__main__":
    main()
