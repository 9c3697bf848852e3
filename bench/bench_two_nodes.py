"""Benchmarks on a real two-node vLLM (CPU, TP=2; the worker node headless in its own network, PID and mount
namespaces behind a real sshd), with the real daemon (`python -m watchdog run`) in the head's PID namespace and
the worker node in ``[[nodes]]``, at default settings, no restart steps (observe and alert only).

    flock /tmp/ew-engine.lock timeout 1500 .venv/bin/python bench/bench_two_nodes.py \\
        [--cpu-seconds 120] [--freezes 5] [--kills 2] [--out bench/results/two-nodes.json]

1. CPU under load (4 streams), one window of ``--cpu-seconds`` for everything, side by side:
   - head: the daemon and every process under it (its ssh master and liveness session, short ssh calls),
     utime+stime from /proc (psutil, reaped children included), against a naive head watcher in the same window:
     a loop doing a GET of /metrics and a full prometheus_client parse at 1 Hz;
   - worker node: the node's sshd and everything under it (the session the head's connection holds, the agent's
     liveness process, short agent calls), against a naive worker poller in the same window, inside the same
     namespaces: a python scanning every process with psutil (pid, cmdline, status) every 2 s, the job the
     liveness stream does (find the ranks and their state), done resident but naively.
2. Suspicion -> stacks of every rank on both nodes on disk: Worker_TP1 on the worker node SIGSTOPped under load,
   ``--freezes`` times: from the first ``suspect`` event after the stop to the bundle whose manifest holds dumps
   of both nodes (the manifest's mtime: it is written last, then the directory is renamed into place); also from
   the SIGSTOP. SIGCONT always, then the engine must be working again.
3. Remote rank exit -> verdict: Worker_TP1 on the worker node SIGKILLed under load: seconds from the kill to the
   daemon's ``node_state`` event ``rank_lost`` naming Worker_TP1 and the node. The pair is then restarted by the
   harness (stop both halves, start worker then head) and the next kill waits for the node to read ``ok`` again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
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
from tests.harness.engine_env import engine_python  # noqa: E402
from tests.harness.load import LoadGenerator  # noqa: E402
from tests.harness.models import fast_model  # noqa: E402
from tests.harness.sshnode import SshNode  # noqa: E402
from tests.harness.two_node import TwoNodeVllm  # noqa: E402
from tests.harness.watcher import event_time  # noqa: E402

NAIVE_HEAD = NAIVE  # the naive head watcher: GET + full prometheus_client parse at 1 Hz
NAIVE_WORKER = """
import time, psutil
while True:
    t0 = time.monotonic()
    ranks = [(p.info["pid"], p.info["status"]) for p in psutil.process_iter(["pid", "cmdline", "status"])
             if p.info["cmdline"] and p.info["cmdline"][0].startswith("VLLM::")]
    time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
"""


def run_ns(pid: int) -> int:
    """Nanoseconds on a CPU of every live thread of ``pid`` (/proc/PID/task/*/schedstat): not rounded to ticks."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
    return total


class TreeCpu:
    """CPU seconds (utime+stime) of a process and everything under it since `__init__`, children that exited and
    were reaped inside the tree included (their parent's children times), counted once. utime/stime move in clock
    ticks (10 ms); `precise` adds up schedstat (ns) of the processes alive at the end instead (those that exited
    in the window, and threads that ended, are not in it)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.t0, self.start = self.snap(), time.monotonic()

    def snap(self) -> tuple[float, dict[tuple[int, float], tuple[float, int]]]:
        def total(p: psutil.Process) -> float:
            t = p.cpu_times()
            return t.user + t.system + t.children_user + t.children_system

        procs = {}
        for c in [self.root, *self.root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, OSError):
                procs[(c.pid, c.create_time())] = (total(c), run_ns(c.pid))
        return total(self.root), procs

    def seconds(self) -> tuple[float, float]:
        """(utime+stime seconds, schedstat seconds of the live processes) since the start."""
        (r0, k0), (r1, k1) = self.t0, self.snap()
        kids0 = {k: v for k, v in k0.items() if k[0] != self.root.pid}
        kids1 = {k: v for k, v in k1.items() if k[0] != self.root.pid}
        ticks = (r1 - r0 + sum(v[0] - kids0.get(k, (0.0, 0))[0] for k, v in kids1.items())
                 - sum(v[0] for k, v in kids0.items() if k not in kids1))  # an exited one reappears in its parent
        precise = sum(v[1] - k0.get(k, (0.0, 0))[1] for k, v in k1.items()) / 1e9
        return ticks, precise


def pct(seconds: float, wall: float) -> float:
    return round(100 * seconds / wall, 3)


class Daemon:
    """`watchdog run` inside the head's PID and mount namespaces (nsenter), in a session of its own."""

    def __init__(self, pair: TwoNodeVllm, state: Path) -> None:
        state.mkdir(parents=True, exist_ok=True)
        self.state = state
        self.config = state / "watchdog.toml"
        self.config.write_text(f'[engine]\nurl = "{pair.url}"\n' + pair.node.toml()
                               + f'log_file = "{pair.run / "worker.log"}"\n')
        self.log = state / "watchdog.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*pair.head_nsenter(), sys.executable, "-m", "watchdog", "run", "--url", pair.url, "--state-dir",
                 str(state), "--config", str(self.config), "--metrics-port", "0"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=str(ROOT))
        self.started = time.time()

    def events(self, since: float = 0.0) -> list[dict[str, Any]]:
        path = self.state / "events.jsonl"
        if not path.exists():
            return []
        out = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return [e for e in out if event_time(e) >= since]

    def wait(self, pred: Any, timeout: float, since: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events(since):
                if pred(e):
                    return e
            if self.proc.poll() is not None:
                raise RuntimeError(f"watchdog exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"no {what} within {timeout}s; events: "
                           f"{[(e['event'], e.get('to') or e.get('state')) for e in self.events(since)][-20:]}")

    def state_is(self, state: str, timeout: float, since: float) -> dict[str, Any]:
        return self.wait(lambda e: e["event"] == "transition" and e["to"] == state, timeout, since, state)

    def current(self, state: str, timeout: float) -> None:
        """Until the engine's latest verdict is ``state`` (entered now or before)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = [e["to"] for e in self.events() if e["event"] == "transition"]
            if last and last[-1] == state:
                return
            time.sleep(0.2)
        raise TimeoutError(f"not {state} within {timeout}s")

    def stop(self) -> None:
        tree = []
        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for p in tree:  # its ssh children run in sessions of their own: end any left, each by its pid
            with contextlib.suppress(psutil.Error):
                p.kill()


def sshd_listener(node: SshNode) -> int:
    """The node's sshd listener: the child of the node's PID 1 named sshd (its sessions are under it)."""
    for p in psutil.Process(node.sshd_pid).children():
        with contextlib.suppress(psutil.Error):
            if p.name() == "sshd":
                return int(p.pid)
    raise RuntimeError("no sshd in the worker node")


def cpu(pair: TwoNodeVllm, d: Daemon, seconds: float) -> dict[str, Any]:
    naive_head = subprocess.Popen([sys.executable, "-c", NAIVE_HEAD, pair.url], start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    naive_worker = subprocess.Popen([*pair.node.nsenter(), sys.executable, "-c", NAIVE_WORKER],
                                    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with LoadGenerator(pair.url, pair.model_name, threads=4, duration=seconds + 60) as load:
            time.sleep(20)  # the load and the pollers settle; the daemon's stream is up
            trees = {"head_watchdog": TreeCpu(d.proc.pid), "head_naive": TreeCpu(naive_head.pid),
                     "worker_watchdog": TreeCpu(sshd_listener(pair.node)), "worker_naive": TreeCpu(naive_worker.pid)}
            load_before = os.getloadavg()
            time.sleep(seconds)
            both = {k: t.seconds() for k, t in trees.items()}
            used = {k: v[0] for k, v in both.items()}
            wall = time.monotonic() - trees["head_watchdog"].start
            stats = load.stop()
    finally:
        for p in (naive_head, naive_worker):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    out: dict[str, Any] = {"seconds": round(wall, 1), "load_average_before": load_before,
                           "load_average_after": os.getloadavg(), "requests_ok": stats.successes,
                           "tokens": stats.completion_tokens}
    for k, v in used.items():
        out[f"{k}_cpu_seconds"] = round(v, 3)
        out[f"{k}_percent_of_a_core"] = pct(v, wall)
        out[f"{k}_schedstat_percent_of_a_core"] = round(100 * both[k][1] / wall, 4)
    for side in ("head", "worker"):
        out[f"{side}_ratio_watchdog_to_naive"] = round(used[f"{side}_watchdog"] / max(used[f"{side}_naive"], 1e-9), 3)
    out["head_goal_0.3_met"] = out["head_watchdog_percent_of_a_core"] <= 0.3
    out["worker_goal_0.2_met"] = out["worker_watchdog_percent_of_a_core"] <= 0.2
    states = [(e.get("to") or e.get("state")) for e in d.events(d.started) if e["event"] in ("transition",
                                                                                           "node_state")]
    out["daemon_states_seen"] = sorted(set(filter(None, states)))
    return out


def both_nodes_bundle(incidents: Path, since: float) -> tuple[Path, float] | None:
    """The first bundle written after ``since`` holding dumps of both nodes, and its manifest's mtime."""
    if not incidents.is_dir():
        return None
    found = []
    for b in incidents.iterdir():
        m = b / "manifest.json"
        if b.name.startswith(".") or not m.is_file() or m.stat().st_mtime < since:
            continue
        nodes = json.loads(m.read_text()).get("nodes", {})
        if nodes.get("local", {}).get("dumps", {}).get("ok") and nodes.get("worker1", {}).get("dumps", {}).get("ok"):
            found.append((b, m.stat().st_mtime))
    return min(found, key=lambda x: x[1]) if found else None


def freezes(pair: TwoNodeVllm, d: Daemon, n: int) -> dict[str, Any]:
    from_suspect, from_stop, rows = [], [], []
    with LoadGenerator(pair.url, pair.model_name, threads=4, duration=n * 120 + 60, request_timeout=120):
        for i in range(n):
            d.current("working", 90)
            time.sleep(5)
            tp1 = psutil.Process(pair.pids("worker")["VLLM::Worker_TP1"])
            tp1.suspend()
            stopped = time.time()
            try:
                suspect = d.state_is("suspect", 60, stopped)
                deadline = time.monotonic() + 60
                while (got := both_nodes_bundle(d.state / "incidents", stopped)) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError("no bundle with both nodes' dumps within 60 s")
                    time.sleep(0.1)
            finally:
                tp1.resume()
            bundle, written = got
            m = json.loads((bundle / "manifest.json").read_text())
            s = event_time(suspect)
            from_suspect.append(round(written - s, 2))
            from_stop.append(round(written - stopped, 2))
            rows.append({"stop_to_suspect_s": round(s - stopped, 2), "suspect_to_bundle_s": from_suspect[-1],
                         "stop_to_bundle_s": from_stop[-1], "bundle": bundle.name, "culprit": m["culprit"],
                         "state": m["state"], "decision": m["decision"],
                         "processes": [p["title"] for p in m["processes"]],
                         "worker_log_lines": m["nodes"]["worker1"]["log_lines"],
                         "files": [f for f in m["files"] if f.startswith("log-tail")]})
            print(f"  freeze {i + 1}: suspect {rows[-1]['stop_to_suspect_s']} s after the stop, bundle with both "
                  f"nodes {from_suspect[-1]} s after suspect ({from_stop[-1]} s after the stop); culprit "
                  f"{m['culprit']}", flush=True)
            d.current("working", 120)
    return {"freezes": n, "runs": rows,
            "suspect_to_bundle_both_nodes_s": from_suspect,
            "median_suspect_to_bundle_s": statistics.median(from_suspect),
            "max_suspect_to_bundle_s": max(from_suspect), "stop_to_bundle_both_nodes_s": from_stop,
            "median_stop_to_bundle_s": statistics.median(from_stop), "max_stop_to_bundle_s": max(from_stop),
            "goal_10s_met": max(from_suspect) <= 10.0}


def kills(pair: TwoNodeVllm, d: Daemon, n: int) -> dict[str, Any]:
    took, rows = [], []
    for i in range(n):
        if i:
            t = time.time()
            pair.do("stop", "head")
            pair.do("stop", "worker")
            pair.start()
            # the node's rank tracker finds the new ranks (it rediscovers every 30 s): ok again before the next kill
            d.wait(lambda e: e["event"] == "node_state" and e["state"] == "ok", 120, t, "node_state ok")
        with LoadGenerator(pair.url, pair.model_name, threads=4, duration=120, request_timeout=30):
            d.current("working", 90)
            time.sleep(5)
            tp1 = psutil.Process(pair.pids("worker")["VLLM::Worker_TP1"])
            tp1.kill()
            killed = time.time()
            e = d.wait(lambda e: e["event"] == "node_state" and e["state"] == "rank_lost"
                       and "Worker_TP1" in e["reason"] and "worker1" in e["reason"], 30, killed, "rank_lost")
        took.append(round(event_time(e) - killed, 2))
        rows.append({"kill_to_rank_lost_s": took[-1], "reason": e["reason"]})
        print(f"  kill {i + 1}: rank_lost {took[-1]} s after the kill: {e['reason']}", flush=True)
    return {"kills": n, "runs": rows, "kill_to_verdict_s": took, "median_kill_to_verdict_s": statistics.median(took),
            "max_kill_to_verdict_s": max(took), "goal_5s_met": max(took) <= 5.0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-seconds", type=float, default=120.0)
    ap.add_argument("--freezes", type=int, default=5)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "two-nodes.json"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # parts measured in earlier runs stay (each part says when and at which commit); this run's replace theirs
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.update({"cores": os.cpu_count(), "load_average_at_start": os.getloadavg()})
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                            text=True, check=False).stdout.strip()

    def save(key: str, value: Any) -> None:  # after each part: a later part's failure keeps the earlier figures
        if isinstance(value, dict):
            value = {**value, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit}
        results[key] = value
        print(json.dumps({k: v for k, v in value.items() if k != "runs"} if isinstance(value, dict) else value),
              flush=True)
        out.write_text(json.dumps(results, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-two-nodes-") as tmp:
        root = Path(tmp)
        log = root / "run" / "worker.log"  # the worker half's log: the one log the head may read there
        node = SshNode(root, f'audit_log = "{root}/node/agent.log"\nlog_file = "{log}"\n').start()
        pair = TwoNodeVllm(root, engine_python(), fast_model(), node)
        d = None
        try:
            t0 = time.monotonic()
            pair.start()
            save("pair_ready_s", round(time.monotonic() - t0, 1))
            d = Daemon(pair, root / "state")
            d.state_is("idle", 90, d.started)
            d.wait(lambda e: e["event"] == "node_state" and e["state"] == "ok", 60, d.started, "node ok")
            if args.cpu_seconds:
                save("cpu" if args.cpu_seconds == 120 else f"cpu_{args.cpu_seconds:g}s", cpu(pair, d, args.cpu_seconds))
            if args.freezes:
                save("suspicion_to_bundle", freezes(pair, d, args.freezes))
            if args.kills:
                save("rank_exit_to_verdict", kills(pair, d, args.kills))
        finally:
            if d is not None:
                d.stop()
            with contextlib.suppress(Exception):
                psutil.Process(pair.pids("worker")["VLLM::Worker_TP1"]).resume()
            pair.close()
            node.close()
    save("load_average_at_end", os.getloadavg())
    print(f"written {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
