"""Benchmark: detection to restart issued, with a webhook that takes 10 s to answer; and detection to ready.

    .venv/bin/python bench/bench_recovery.py [--runs 2] [--out bench/results/recovery.json]

A real vLLM (CPU build, TP=2) started by tests/harness/restart_vllm.py; the watchdog with default judgement
settings (stacks on suspicion) and one `command` restart step (the same script). Worker_TP1 is stopped under
load and left stopped until the restart is issued. From the watchdog's own events:

- detection -> restart issued: the `frozen` transition to `restart_started` (evidence is taken in between);
- detection -> ready: `frozen` to `recovered` (the first successful max_tokens=1 generation of the new server).

Each run is done twice over: with one webhook sink answering after 10 s, and with no sink (the reference in the
same session): their ratio shows what the slow receiver costs the restart.

A third kind of run, `engine_exits` (with the same slow webhook): the whole server is SIGKILLed, as when vLLM's own
300 s timeout ends it. Nothing is left to take stacks of, so the restart follows the incident's bundle (the log
tail, the GPUs) at once:

- kill -> incident: `incident_opened` after `restart.down_after` (default 10 s);
- incident -> restart issued: `incident_opened` to `restart_started`: the down bundle written, then the next pass
  (tests/engine/test_recovery.py measured 0.5 s + 0.5 s at a 0.5 s scrape interval).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness.engine_env import engine_python  # noqa: E402
from tests.harness.faults import frozen  # noqa: E402
from tests.harness.load import LoadGenerator  # noqa: E402
from tests.harness.models import fast_model  # noqa: E402
from tests.harness.restart_vllm import ScriptedServer, read_pid, stop_group  # noqa: E402
from tests.harness.watcher import WatchdogProcess, event_time  # noqa: E402
from tests.receiver import Receiver  # noqa: E402


def one_run(tmp: Path, slow_hook: bool, fault: str = "freeze") -> dict[str, float]:
    server = ScriptedServer(engine_python(), fast_model(), tmp)
    hook: Receiver | None = None
    try:
        server.run_script()
        server.wait_ready(300)
        sinks = ""
        if slow_hook:
            import threading

            hook = Receiver(lambda _n: (200, 10.0))
            threading.Thread(target=hook.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            sinks = f'[[alerts.sinks]]\nkind = "webhook"\nurl = "{hook.url}"\ntimeout = 30\n'
        cfg = (f"[state]\ntrace_max_bytes = 0\n[exporter]\nport = 0\n[restart]\nboot_timeout = 300.0\n"
               f"[[restart.steps]]\nkind = \"command\"\nargv = {json.dumps(server.argv)}\ntimeout = 120\n{sinks}")
        wd = WatchdogProcess(server.url, tmp / "wd", cfg).start()
        try:
            wd.wait_for_state("idle", 120)
            if fault == "exit":
                killed = time.time()
                os.killpg(server.pid, signal.SIGKILL)  # the server's own group (its pid), nothing else
                opened = wd.wait_event("incident_opened", 120)
                started = wd.wait_event("restart_started", 120)
                recovered = wd.wait_event("recovered", 400)
                return {"kill_to_incident": event_time(opened) - killed,
                        "incident_to_restart": event_time(started) - event_time(opened),
                        "restart_to_ready": event_time(recovered) - event_time(started)}
            with LoadGenerator(server.url, server.model.name, threads=4, duration=600, request_timeout=600):
                time.sleep(5)
                with frozen(server.process("VLLM::Worker_TP1")):
                    stopped = time.time()
                    started = wd.wait_event("restart_started", 240)
                recovered = wd.wait_event("recovered", 400)
        finally:
            wd.stop()
        frozen_at = next(event_time(e) for e in wd.events() if e.get("to") == "frozen")
        captured = next((event_time(e) for e in wd.events() if e["event"] == "evidence_captured"), float("nan"))
        return {"stop_to_frozen": frozen_at - stopped, "frozen_to_evidence": captured - frozen_at,
                "frozen_to_restart": event_time(started) - frozen_at,
                "frozen_to_ready": event_time(recovered) - frozen_at,
                "restart_to_ready": event_time(recovered) - event_time(started)}
    finally:
        if hook is not None:
            hook.stop.set()
            hook.shutdown()
            hook.server_close()
        pid = read_pid(server.pidfile)
        if pid is not None:
            stop_group(pid)


def summary(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {k: {"median": round(statistics.median(r[k] for r in runs), 2), "max": round(max(r[k] for r in runs), 2)}
            for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "recovery.json"))
    a = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"slow_webhook_10s": [], "no_sink": [], "engine_exits": []}
    for i in range(a.runs):
        for name, slow, fault in (("slow_webhook_10s", True, "freeze"), ("no_sink", False, "freeze"),
                                  ("engine_exits", True, "exit")):
            with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
                r = one_run(Path(tmp), slow, fault)
            print(f"run {i + 1} {name}: " + ", ".join(f"{k} {v:.1f}s" for k, v in r.items()), flush=True)
            results[name].append(r)
    out = {name: {"runs": runs, **summary(runs)} for name, runs in results.items()}
    slow, ref = out["slow_webhook_10s"]["frozen_to_restart"], out["no_sink"]["frozen_to_restart"]
    out["ratio_restart_slow_vs_no_sink"] = round(slow["median"] / ref["median"], 2) if ref["median"] else None
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict) or "runs" not in v}, indent=2))
    for name in results:
        print(name, json.dumps({k: v for k, v in out[name].items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
