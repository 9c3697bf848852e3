"""Make tests/data/livelock/ from the real CPU vLLM: per fault, a `watchdog record` trace and the real py-spy dumps.

    .venv/bin/python -m tests.harness.inject.record_livelock [OUT_DIR]

Starts the fast model with the injection (one vLLM; stop any other first: the machine has 2 cores), then for each
fault: puts the engine in the fault (admission_stall: one request sent while no waiting request is admitted;
livelock: two long requests running, then no token scheduled for them), records the page with `watchdog record`
for RECORD_S seconds from just before the fault, and in the middle takes the stacks exactly as the daemon does on a
suspicion (`Investigator.investigate`: the page's running/waiting, two py-spy rounds `capture.gap` apart, /proc
facts). Writes, per fault: ``<fault>.trace.jsonl``, ``<fault>/round<N>-<title>.json`` (py-spy --json as taken),
``<fault>/capture.json`` (processes, per dump its time and /proc facts, the page, and what the findings said then).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.harness import engine_env, models
from tests.harness.inject import injected_env
from tests.harness.load import BackgroundRequest
from tests.harness.metrics import watched
from tests.harness.server import VllmServer
from watchdog.config.load import Config
from watchdog.evidence.bundle.investigate import Evidence, Investigator
from watchdog.scrape.engine_http import EngineHTTP

RECORD_S = 30.0
STACKS_AFTER_S = 12.0  # into the fault: past a quick config's suspect_after, as the daemon would


def page(server: VllmServer) -> tuple[float, float]:
    p = watched(server.metrics())
    return p.get("vllm:num_requests_running", 0.0), p.get("vllm:num_requests_waiting", 0.0)


def wait_page(server: VllmServer, ok: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok(*page(server)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"page: {page(server)}")


def save(out: Path, fault: str, ev: Evidence) -> None:
    d = out / fault
    d.mkdir(parents=True, exist_ok=True)
    titles = {p.pid: p.title for p in ev.capture.processes}
    rounds = []
    for i, rnd in enumerate(ev.capture.rounds, 1):
        facts = {}
        for pid, dump in sorted(rnd.items()):
            name = f"round{i}-{titles[pid].replace('::', '-') or pid}.json"
            (d / name).write_text(json.dumps(json.loads(dump.output), indent=1) + "\n" if dump.ok else "")
            f = dump.facts
            facts[str(pid)] = {"file": name, "ok": dump.ok, "t": round(dump.t, 3), "nonblocking": dump.nonblocking,
                               "state": f.state if f else None, "wchan": f.wchan if f else None,
                               "cpu_seconds": f.cpu_seconds if f else None, "threads": f.threads if f else None}
        rounds.append(facts)
    fi = ev.findings
    (d / "capture.json").write_text(json.dumps({
        "processes": [{"pid": p.pid, "role": p.role.value, "title": p.title, "ranks": p.ranks, "ppid": p.ppid}
                      for p in ev.capture.processes],
        "rounds": rounds,
        "page": {"running": fi.page.running, "waiting": fi.page.waiting} if fi.page else None,
        "findings_when_recorded": {"decision": fi.decision.value,
                                   "stuck_kind": fi.stuck_kind.value if fi.stuck_kind else None,
                                   "reason": fi.reason},
    }, indent=1) + "\n")


def record(server: VllmServer, out: Path, fault: str, flag: Path, start_fault: Any) -> None:
    trace = out / f"{fault}.trace.jsonl"
    rec = subprocess.Popen([sys.executable, "-m", "watchdog", "record", "--url", server.url, "--seconds",
                            str(RECORD_S), "--out", str(trace)], start_new_session=True)
    try:
        time.sleep(4.0)  # a few healthy samples first
        pending = start_fault()
        time.sleep(STACKS_AFTER_S)
        ev = Investigator(Config(), EngineHTTP(server.url)).investigate(work_pending=True)
        print(f"{fault}: {ev.findings.decision.value} {ev.findings.stuck_kind}: {ev.findings.reason}", flush=True)
        save(out, fault, ev)
        rec.wait(RECORD_S + 30)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait(10)
        flag.write_text("")
    for r in pending:
        r.result(300)


def main(out: Path) -> None:
    py = engine_env.engine_python()
    model = models.ensure_model(models.FAST, py)
    with tempfile.TemporaryDirectory() as tmp:
        flag = Path(tmp) / "fault"
        flag.write_text("")
        with VllmServer(py, model, Path(tmp), name="vllm-record-livelock", env=injected_env(flag)) as server:
            server.wait_ready(240)

            def stall() -> list[BackgroundRequest]:
                flag.write_text("admission_stall")
                time.sleep(0.5)
                reqs = [BackgroundRequest(server.url, server.model_name, "admit me", max_tokens=4, timeout=400)]
                wait_page(server, lambda r, q: r == 0 and q >= 1)
                return reqs

            def livelock() -> list[BackgroundRequest]:
                reqs = [BackgroundRequest(server.url, server.model_name, f"keep going {i}", max_tokens=600,
                                          timeout=400, ignore_eos=True) for i in range(2)]
                wait_page(server, lambda r, q: r >= 1)
                time.sleep(2.0)
                flag.write_text("livelock")
                return reqs

            record(server, out, "admission_stall", flag, stall)
            record(server, out, "livelock", flag, livelock)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "data" / "livelock")
