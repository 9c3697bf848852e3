"""Two real vLLMs behind one real HAProxy, frozen under client load: the watchdog's /readyz against vLLM's /health.

Two CPU vLLMs (TP=1 by default: two TP=2 engines on the 2 cores here took over two minutes to start and served ~4
tokens/s each; TP=1 with the mp executor still has a `VLLM::Worker` to freeze), each started by
tests/harness/restart_vllm.py and watched by its own `watchdog run` whose restart step is that same script. One
HAProxy with two proxies over the same two engines:

- ``via_readyz``: `option httpchk GET /readyz` on each engine's watchdog (`check port`), out on `shutdown-sessions`;
- ``via_health``: `option httpchk GET /health` on each engine itself, as deployments do today.

The same client loop (threads, max_tokens, timeout) runs through each, so both see the same engines, the same load
and the same freeze: engine 1's worker is stopped (SIGSTOP) until the watchdog's restart ends it. The restart begins
`hold` seconds after `restart_started` (a pre-start hook that sleeps): here the stacks are taken on suspicion and the
restart follows `frozen` within a second, so without it both proxies would see the engine die at once. In production
a freeze lasts longer than that before anything ends the engine: the GPU evidence waits up to `gpu.fr_settle`, a held
restart up to `restart.hold_max`, a dry run, a spent budget or no restart step never end it, and then only vLLM's own
300 s timeout (for a worker) or the kubelet does. The hold is that stretch, kept short. `run` returns the
timeline and what the clients of each proxy saw. Every process started here runs in its own session and is ended by
its own pid before `run` returns; only loopback is used.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.harness.faults import frozen
from tests.harness.haproxy import HAProxy, StateWatch, listen_section
from tests.harness.restart_vllm import ScriptedServer, read_pid, stop_group
from tests.harness.server import free_port
from tests.harness.watcher import WatchdogProcess, event_time, quick_config

PROXIES = ("via_readyz", "via_health")
FROZEN = "e1"


@dataclass(frozen=True)
class Sent:
    began: float  # epoch seconds
    ended: float
    outcome: str  # ok | failed (an answer that is not 200, or the connection broke) | hung (no answer in time)
    engine: str  # which engine answered (HAProxy's X-Engine header), "" without an answer


class ClientLoop:
    """`threads` clients posting completions through `url` in a loop, each request recorded."""

    def __init__(self, url: str, model: str, threads: int, request_timeout: float, seed: int) -> None:
        self.url, self.model, self.timeout, self.seed = url, model, request_timeout, seed
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"client-{seed}-{i}")
                         for i in range(threads)]

    def start(self) -> ClientLoop:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Sent]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 10)
        return list(self.sent)

    def _loop(self, i: int) -> None:
        rng = random.Random(self.seed * 100 + i)
        with requests.Session() as session:
            while not self._stop.is_set():
                body = {"model": self.model, "prompt": f"client {i} {rng.random()}", "max_tokens": rng.randint(4, 24),
                        "ignore_eos": True, "temperature": 1.0}
                began = time.time()
                try:
                    r = session.post(f"{self.url}/v1/completions", json=body, timeout=self.timeout)
                    outcome, engine = ("ok" if r.status_code == 200 else "failed"), r.headers.get("X-Engine", "")
                except requests.Timeout:
                    outcome, engine = "hung", ""
                    session.close()  # a timed-out connection is not reused
                except requests.RequestException:
                    outcome, engine = "failed", ""
                with self._lock:
                    self.sent.append(Sent(began, time.time(), outcome, engine))
                if outcome != "ok":
                    self._stop.wait(0.2)


def wait_for(what: str, predicate: Any, timeout: float, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(every)


def watchdog_config(server: ScriptedServer, hold: float) -> str:
    return quick_config(5.0, 25.0, 10.0, f"""
[capture]
timeout = 30.0
[restart]
pre_start = ["sleep", "{hold:g}"]
boot_timeout = 400.0
evidence_timeout = 120.0
down_after = 5.0
[[restart.steps]]
kind = "command"
argv = {json.dumps(server.argv)}
timeout = 120
""")


def ready(port: int) -> int:
    try:
        return requests.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
    except requests.RequestException:
        return 0


def run(tmp: Path, engine_python: Path, model: Path, *, tp: int = 1, threads: int = 3,
        request_timeout: float = 30.0, hold: float = 20.0) -> dict[str, Any]:
    began = time.monotonic()
    servers = [ScriptedServer(engine_python, model, tmp / f"e{i}", tensor_parallel_size=tp) for i in range(2)]
    watchdogs: list[WatchdogProcess] = []
    lb: HAProxy | None = None
    try:
        for s in servers:
            s.run_script()
        for s in servers:
            s.wait_ready(400)
        ports = [free_port() for _ in servers]
        for i, s in enumerate(servers):
            wd = WatchdogProcess(s.url, tmp / f"wd{i}", watchdog_config(s, hold), metrics_port=ports[i])
            watchdogs.append(wd.start())
        for w, p in zip(watchdogs, ports, strict=True):
            w.wait_for_state("idle", 120)
            wait_for("the watchdog's /readyz says 200", lambda p=p: ready(p) == 200, 60)
        lb_ports = {"via_readyz": free_port(), "via_health": free_port()}
        engines = [(f"e{i}", s.port) for i, s in enumerate(servers)]
        lb = HAProxy(tmp / "haproxy", [
            listen_section("via_readyz", lb_ports["via_readyz"], "/readyz",
                           [(name, port, ports[i]) for i, (name, port) in enumerate(engines)], shutdown_on_down=True),
            listen_section("via_health", lb_ports["via_health"], "/health", [(n, p, None) for n, p in engines]),
        ]).start()
        with StateWatch(lb) as states:
            wait_for("every server UP in both proxies", lambda: len(states.changes) >= 4 and all(
                lb.states().get((px, e)) == "UP" for px in PROXIES for e in ("e0", "e1")), 60)
            clients = {px: ClientLoop(f"http://127.0.0.1:{lb_ports[px]}", model.name, threads, request_timeout,
                                      seed=n).start() for n, px in enumerate(PROXIES)}
            try:
                wait_for("both engines serving through both proxies", lambda: all(
                    {"e0", "e1"} <= {s.engine for s in c.sent if s.outcome == "ok"} for c in clients.values()), 120)
                first_pid = servers[1].pid
                with frozen(servers[1].process("VLLM::Worker" if tp == 1 else "VLLM::Worker_TP1")):
                    fault = time.time()
                    restart = watchdogs[1].wait_event("restart_started", 240)
                    # stopped until the restart ends it (the script writes the new server's pid once the old group is
                    # gone): continued earlier, the engine would move again during the hold and be back in rotation
                    wait_for("the restart ended the frozen server", lambda: read_pid(servers[1].pidfile) != first_pid,
                             240)
                    gone = time.time()
                recovered = watchdogs[1].wait_event("recovered", 400)
                def back_of(px: str) -> float | None:  # UP again after the first DOWN since the fault
                    down = states.first((px, FROZEN), "DOWN", after=fault)
                    return None if down is None else states.first((px, FROZEN), "UP", after=down)

                for px in PROXIES:
                    wait_for(f"{FROZEN} back in {px}", lambda px=px: back_of(px) is not None, 120)
                back = {px: back_of(px) for px in PROXIES}
                back_at = max(t for t in back.values() if t is not None)
                wait_for(f"{FROZEN} serving again through both proxies", lambda: all(any(
                    s.engine == FROZEN and s.began > back_at and s.outcome == "ok" for s in c.sent)
                    for c in clients.values()), 120)
            finally:
                sent = {px: c.stop() for px, c in clients.items()}
        assert servers[1].pid != first_pid, "the watchdog's restart started a new server"
        frozen_at = event_time(watchdogs[1].wait_for_state("frozen", 5, after=fault))
        # nothing ends the frozen engine before the hook's hold is over: the restart step runs after it
        timeline = {"fault": fault, "frozen": frozen_at, "restart_started": event_time(restart),
                    "engine_ended_not_before": event_time(restart) + hold, "engine_gone_seen": gone,
                    "recovered": event_time(recovered)}
        report = {"tp": tp, "threads_per_proxy": threads, "request_timeout": request_timeout, "restart_hold": hold,
                  "timeline_s": {k: round(v - fault, 2) for k, v in timeline.items()},
                  "proxies": {px: proxy_report(px, sent[px], lb, states, timeline, back[px]) for px in PROXIES},
                  "state_changes": [(round(t - fault, 2), f"{k[0]}/{k[1]}", s) for t, k, s in states.changes]}
        report["scenario_seconds"] = round(time.monotonic() - began, 1)
        return report
    finally:
        if lb is not None:
            lb.stop()
        for w in watchdogs:
            w.stop()
        for s in servers:
            pid = read_pid(s.pidfile)
            if pid is not None:
                stop_group(pid)


def proxy_report(px: str, sent: list[Sent], lb: HAProxy, states: StateWatch, timeline: dict[str, float],
                 back: float | None) -> dict[str, Any]:
    fault, ending = timeline["fault"], timeline["engine_ended_not_before"]
    out_at = states.first((px, FROZEN), "DOWN", after=fault)
    end = back if back is not None else time.time()
    episode = [s for s in sent if s.ended >= fault and s.began <= end]  # in flight at the fault, or sent before back
    bad = [s for s in episode if s.outcome != "ok"]
    key = (px, FROZEN)
    # from HAProxy's own count of requests given to the server (the request log has no line for one that hangs or
    # is cut: it ends without a response); "after out" from the first poll that saw it DOWN to the last before UP
    to_frozen = states.sent_between(key, fault, ending)
    until = back - 1e-6 if back is not None else time.time()  # the poll that saw it UP again counts no more
    after_out = 0 if out_at is None else states.sent_between(key, out_at, until)
    answered = [r for r in lb.requests() if r.proxy == px and r.server == FROZEN and fault <= r.accepted < ending]
    oks = sorted(s.ended for s in episode if s.outcome == "ok")
    gaps = [b - a for a, b in zip([fault, *oks], [*oks, end], strict=True)]
    calm = [s.ended - s.began for s in sent if s.outcome == "ok" and s.ended < fault]
    return {
        "out_of_rotation_after_fault_s": None if out_at is None else round(out_at - fault, 2),
        "out_of_rotation_after_frozen_s": None if out_at is None else round(out_at - timeline["frozen"], 2),
        "out_while_frozen": out_at is not None and out_at < ending,  # before anything ended the engine
        "status_until_engine_ended": states.status_at((px, FROZEN), ending),
        "back_in_rotation_after_recovered_s": None if back is None else round(back - timeline["recovered"], 2),
        "requests_in_episode": len(episode),
        "ok": len(episode) - len(bad),
        "failed": sum(s.outcome == "failed" for s in bad),
        "hung": sum(s.outcome == "hung" for s in bad),
        "client_seconds_lost": round(sum(s.ended - s.began for s in bad), 1),
        "sent_to_frozen_engine_while_frozen": to_frozen,
        "sent_to_frozen_engine_after_out": after_out,
        "answered_by_frozen_engine_while_frozen": len(answered),
        "longest_stretch_without_a_completion_s": round(max(gaps), 1),
        "median_request_s_before_fault": round(statistics.median(calm), 2) if calm else None,
    }
