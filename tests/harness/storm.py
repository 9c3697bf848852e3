"""A storm of faults against a real vLLM (CPU build, TP=2) under steady load, watched by the real `watchdog run`.

    with Storm(engine_python, model, tmp, seed) as storm:
        storm.run(seconds)            # faults in an order drawn from the seed, each bounded and undone
        report = storm.report()       # what was checked, every problem found, the figures

The parts are the real ones: the restart script's vLLM with the tests' fault injection, a webhook receiver that
can be slow or down (`tests/receiver.py`), the state directory on a tmpfs of its own (run as root) so that it can
be filled for real, and the watchdog killed with SIGKILL and started again as systemd would. The faults are in
`tests/harness/storm_faults.py`, the checks in `tests/harness/storm_checks.py`. Thresholds and intervals are
shortened; the code paths are the product's.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from tests.harness import storm_checks as checks
from tests.harness.load import LoadGenerator
from tests.harness.metrics import sample_sums
from tests.harness.restart_vllm import ScriptedServer, read_pid, stop_group
from tests.harness.server import free_port
from tests.harness.watcher import WatchdogProcess, event_time, quick_config
from tests.receiver import Receiver
from watchdog.service.events import generations

SINK = "storm"
CLOCK_STEP = Path(__file__).with_name("clock_step")  # its sitecustomize steps the watchdog's wall clock
EVENTS_MAX = 64 * 1024  # state.events_max_bytes: small, so that a storm of minutes rolls the log over
INCIDENTS_MAX, INCIDENTS_BYTES = 4, 8 * 1024 * 1024
TMPFS_BYTES = 48 * 1024 * 1024
SCRAPE_DEADLINE = 10.0  # the config's scrape.deadline (its default): a pass never waits longer for the page
FILLER = "storm-filler"  # the disk-full fault's file in the state directory (tests/harness/storm_faults.py)
# all the state directory may hold: two generations of the event log and two of the delivery log, the bundles,
# status, recovery and the rest
STATE_BOUND = 4 * EVENTS_MAX + INCIDENTS_BYTES + 1024 * 1024


@dataclass
class FaultRun:
    name: str
    started: float  # wall
    ended: float = 0.0
    incidents: list[str] = field(default_factory=list)
    restarts: int = 0  # restart_started of its incidents (counted as it ends: the event log rolls over)
    outcome: str = ""
    problems: list[str] = field(default_factory=list)


@dataclass
class Life:
    """One run of the watchdog process, between two kills: its resources as sampled."""

    pid: int
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    max_gap: float = 0.0  # the longest wait between two passes that read the page (from its scrape counter)


class Storm:
    def __init__(self, engine_python: Path, model: Path, tmp: Path, seed: int) -> None:
        self.tmp, self.seed = tmp, seed
        self.rng = random.Random(seed)
        self.inject = tmp / "fault"
        self.inject.write_text("")
        self.fail_flag = tmp / "restart-fault"
        self.fail_flag.write_text("")
        self.clock_file = tmp / "clock-offset"  # the watchdog's wall clock, seconds off (tests/harness/clock_step)
        self.clock_file.write_text("0")
        self.server = ScriptedServer(engine_python, model, tmp, inject=self.inject)
        self.state_dir = tmp / "state"
        self.state_dir.mkdir()
        self.tmpfs = os.geteuid() == 0
        self.receiver_mode = "ok"  # ok, slow, down
        self.receiver = Receiver(self._answer)
        self.watchdog: WatchdogProcess | None = None
        self.load: LoadGenerator | None = None
        self.metrics_port = free_port()
        self.runs: list[FaultRun] = []
        self.lives: list[Life] = []
        self.kills = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="storm-sampler", daemon=True)
        self._threads: list[threading.Thread] = []
        self.high_water = 0
        self.quiet: list[tuple[float, float]] = []  # (from, to) wall: the receiver down, the watchdog killed
        self.full: list[tuple[float, float]] = []  # (from, to) wall: the state directory was full

    # -- the parts -------------------------------------------------------------------------------------------------

    def __enter__(self) -> Storm:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        if self.tmpfs:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "storm-state",
                            str(self.state_dir)], check=True, timeout=30)
        t = threading.Thread(target=self.receiver.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        self._threads.append(t)
        self.server.run_script()
        self.server.wait_ready(300)
        self.start_watchdog()
        assert self.watchdog is not None
        self.watchdog.wait_for_state("idle", 120)
        self.load = LoadGenerator(self.server.url, self.server.model.name, threads=3, duration=None,
                                  request_timeout=60, seed=self.seed).start()
        self._sampler.start()

    def config(self) -> str:
        restart = [sys.executable, str(Path(__file__).with_name("storm_restart.py")), str(self.fail_flag), "--",
                   *self.server.argv]
        return quick_config(3.0, 8.0, 10.0, f"""
[capture]
timeout = 30.0
log_file = {json.dumps(str(self.server.log_path))}
[incidents]
max_count = {INCIDENTS_MAX}
max_bytes = {INCIDENTS_BYTES}
[restart]
boot_timeout = 240.0
evidence_timeout = 60.0
down_after = 4.0
budget = 1000
backoff_initial = 3.0
backoff_max = 10.0
[[restart.steps]]
kind = "command"
argv = {json.dumps(restart)}
timeout = 160
[alerts]
attempts = 6
retry_for = 25.0
blind_after = 8.0
[[alerts.sinks]]
kind = "webhook"
name = "{SINK}"
url = {json.dumps(self.receiver.url)}
timeout = 10
""", state=f"events_max_bytes = {EVENTS_MAX}\n")

    def start_watchdog(self) -> WatchdogProcess:
        path = os.pathsep.join(p for p in (str(CLOCK_STEP), os.environ.get("PYTHONPATH", "")) if p)
        self.watchdog = WatchdogProcess(self.server.url, self.state_dir, self.config(), metrics_port=self.metrics_port,
                                        env={"PYTHONPATH": path, "WATCHDOG_TEST_CLOCK": str(self.clock_file)}).start()
        self.lives.append(Life(self.watchdog.pid))
        return self.watchdog

    def kill_watchdog(self) -> None:
        """SIGKILL, as the OOM killer or a crash would; systemd (here, the storm) starts it again at once."""
        assert self.watchdog is not None
        killed = time.time()
        self.watchdog.kill()
        self.kills += 1
        self.start_watchdog()
        self.quiet.append((killed, time.time() + 2))

    def close(self) -> None:
        self._stop.set()
        if self._sampler.is_alive():
            self._sampler.join(5)
        if self.load is not None:
            self.load.stop(5)
        if self.watchdog is not None:
            self.watchdog.stop()
        self.inject.write_text("")
        self.fail_flag.write_text("")
        self.clock_file.write_text("0")
        pid = read_pid(self.server.pidfile)
        if pid is not None:
            stop_group(pid)
        self.receiver.stop.set()
        self.receiver.shutdown()
        self.receiver.server_close()
        for t in self._threads:
            t.join(5)
        self.copy_state()
        if self.tmpfs and os.path.ismount(self.state_dir):
            subprocess.run(["umount", str(self.state_dir)], check=False, timeout=30)

    def copy_state(self) -> None:
        """What the watchdog left, kept beside the test's files once the tmpfs is gone (for a failed run's report)."""
        keep = self.tmp / "state-copy"
        for p in self.state_dir.glob("*.json*"):
            keep.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (keep / p.name).write_bytes(p.read_bytes())

    def _answer(self, _n: int) -> tuple[int, float]:
        mode = self.receiver_mode
        return (503, 0.0) if mode == "down" else (200, 2.0 if mode == "slow" else 0.0)

    # -- what is read ----------------------------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        return checks.read_jsonl(generations(self.state_dir / "events.jsonl"))[0]

    def earlier(self) -> set[str]:
        """The incidents of the faults before this one: theirs, whatever their stamps say (a clock step stamps an
        incident an hour ahead, so it reads as after every fault of the next hour; seen: seed 1196976446)."""
        return {i for r in self.runs[:-1] for i in r.incidents}

    def wait_event(self, name: str, after: float, timeout: float, incident: str | None = None,
                   where: Callable[[dict[str, Any]], bool] | None = None, **match: Any) -> dict[str, Any]:
        """The first event ``name`` written at or after ``after`` (wall), of ``incident`` if given (else of no
        earlier fault's incident), for which ``where`` holds if given."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            earlier = self.earlier() if incident is None else set()
            for e in self.events():
                if (e.get("event") == name and event_time(e) >= after - 0.001
                        and (e.get("incident") == incident if incident is not None
                             else e.get("incident") not in earlier)
                        and all(e.get(k) == v for k, v in match.items()) and (where is None or where(e))):
                    return e
            w = self.watchdog
            if w is not None and not w.alive():
                raise AssertionError(f"the watchdog exited:\n{w.log_tail()}")
            time.sleep(0.3)
        raise AssertionError(f"no {name} {match or ''} after {after:.1f} within {timeout}s: "
                             f"{[e.get('event') for e in self.events()][-30:]}")

    def _sample(self) -> None:
        last_count, last_at = -1.0, time.monotonic()
        pid = -1
        while not self._stop.wait(0.5):
            w = self.watchdog
            if w is None or not self.lives:
                continue
            life = self.lives[-1]
            if life.pid != pid:
                pid, last_count, last_at = life.pid, -1.0, time.monotonic()
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    life.rss.append(proc.memory_info().rss)
                    life.fds.append(proc.num_fds())
                    life.threads.append(proc.num_threads())
                page = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).text
            except (psutil.Error, requests.RequestException):
                continue
            count = sample_sums(page, ("watchdog_scrapes_total",)).get("watchdog_scrapes_total", 0.0)
            now = time.monotonic()
            if count != last_count:
                if last_count >= 0:
                    life.max_gap = max(life.max_gap, now - last_at)
                last_count, last_at = count, now
            with contextlib.suppress(OSError):
                # what the watchdog keeps: the disk-full fault's own filler is not the watchdog's
                self.high_water = max(self.high_water, checks.tree_bytes(self.state_dir, (FILLER,)))

    # -- the run ---------------------------------------------------------------------------------------------------

    def run(self, seconds: float, names: list[str] | None = None, min_faults: int = 0,
            progress: Path | None = None) -> None:
        """Faults until ``seconds`` are up and at least ``min_faults`` have run (or the first problem); the report so
        far written to ``progress`` after each (a run cut short keeps its figures)."""
        from tests.harness.storm_faults import FAULTS, WEIGHTS

        pool = names or list(FAULTS)
        if "disk_full" in pool and not self.tmpfs:
            pool.remove("disk_full")
        order = list(pool)
        self.rng.shuffle(order)  # every kind once first, then drawn by weight
        end = time.monotonic() + seconds
        while time.monotonic() < end or len(self.runs) < min_faults:
            name = order.pop(0) if order else self.rng.choices(pool, [WEIGHTS.get(n, 1) for n in pool])[0]
            run = FaultRun(name, time.time())
            self.runs.append(run)
            print(f"storm seed {self.seed}: fault {len(self.runs)} {name}", flush=True)
            try:
                run.outcome = FAULTS[name](self, run)
            except AssertionError as e:
                run.problems.append(f"{name}: {e}")
            run.ended = time.time()
            run.restarts = sum(e.get("event") == "restart_started" and e.get("incident") in run.incidents
                               for e in self.events())
            self.drain()
            run.problems += self.check()
            if progress is not None:
                progress.write_text(json.dumps(self.report(), indent=1) + "\n")
            if run.problems:
                print("\n".join(run.problems), flush=True)
                return
            self.settle()

    def drain(self, timeout: float = 60.0) -> None:
        """Wait (bounded) for the alerts still on their way and their lines in the delivery log: delivery is
        asynchronous, a slow receiver takes seconds per alert, so an incident just resolved may have its last alerts
        queued; and the receiver holds an alert before the watchdog has its answer and writes the line (seen: seed
        777299705, the check read the log between the two). A loss lasts past the wait and is reported."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._alerts_unsettled():
            time.sleep(0.5)

    def _alerts_unsettled(self) -> list[str]:
        bodies = self.receiver.bodies()
        ledger, _torn = checks.read_jsonl(generations(self.state_dir / "alerts.jsonl"))
        return checks.alert_problems(bodies, self.events(), self.quiet) + checks.ledger_problems(
            bodies, ledger, SINK, self.kills, self.full)

    def settle(self, timeout: float = 300.0) -> None:
        """Wait until the watchdog holds no incident and the load has had a request served since the last fault
        (the next fault starts from calm, under load that is served)."""
        served = self.load.stats.successes if self.load else 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            engines = status.get("engines") or [{}]
            if status.get("incident") is None and engines[0].get("state") in ("working", "idle") \
                    and not status.get("blind") and (self.load is None or self.load.stats.successes > served):
                return
            time.sleep(0.5)
        raise AssertionError(f"not calm and served within {timeout}s: {self.status()}")

    def status(self) -> dict[str, Any]:
        try:
            doc = json.loads((self.state_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def check(self) -> list[str]:
        events, bad = checks.read_jsonl(generations(self.state_dir / "events.jsonl"))
        problems = [f"{bad} unreadable lines in events.jsonl"] if bad > self.kills else []
        problems += checks.incident_problems(events, self.full)
        problems += checks.alert_problems(self.receiver.bodies(), events, self.quiet)
        ledger, _torn = checks.read_jsonl(generations(self.state_dir / "alerts.jsonl"))
        problems += checks.ledger_problems(self.receiver.bodies(), ledger, SINK, self.kills, self.full)
        problems += checks.state_problems(self.state_dir, events)
        problems += checks.disk_problems(self.state_dir, STATE_BOUND, INCIDENTS_MAX, INCIDENTS_BYTES)
        return problems

    def report(self) -> dict[str, Any]:
        bodies = self.receiver.bodies()
        longest = max(self.lives, key=lambda lf: len(lf.rss))
        half = len(longest.rss) // 2  # growth: the second half of the longest life against its first

        def growth(xs: list[int]) -> int:
            return (max(xs[half:]) - max(xs[:half])) if half else 0

        return {
            "seed": self.seed,
            "faults": len(self.runs),
            "by_fault": {n: sum(r.name == n for r in self.runs) for n in sorted({r.name for r in self.runs})},
            "problems": [p for r in self.runs for p in r.problems],
            "incidents": len({i for r in self.runs for i in r.incidents}),
            "restarts": sum(r.restarts for r in self.runs),
            "alerts_received": len(bodies),
            "alerts_received_twice": checks.duplicates(bodies),
            "watchdog_kills": self.kills,
            "lives": len(self.lives),
            "longest_life_samples": len(longest.rss),
            "rss_growth_bytes": growth(longest.rss),
            "fd_growth": growth(longest.fds),
            "thread_growth": growth(longest.threads),
            "rss_max_bytes": max((max(lf.rss) for lf in self.lives if lf.rss), default=0),
            "max_pass_gap_s": round(max(lf.max_gap for lf in self.lives), 2),
            "disk_high_water_bytes": self.high_water,
            "load": {"ok": self.load.stats.successes if self.load else 0,
                     "failed": self.load.stats.failures if self.load else 0,
                     "last_errors": self.load.stats.errors[-3:] if self.load else []},
            "runs": [{"name": r.name, "seconds": round(r.ended - r.started, 1), "outcome": r.outcome,
                      "incidents": r.incidents, "restarts": r.restarts} for r in self.runs],
        }
