"""The act stage end to end: the real daemon process, a small fake engine, a real restart command, real webhook
receivers. (The real vLLM restarted this way is in tests/engine/test_recovery.py.)"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.facts import line_of, says
from tests.fakes import FAST, EngineModel, fake_engine, wait_for
from tests.receiver import Receiver

SECRET = "act-test-hmac-secret"

# what a restart command does to the fake engine: a POST to its control endpoint (counters start from zero)
RESTART = ("import pathlib, sys, time, urllib.request as u; pathlib.Path(sys.argv[3]).touch(); "
           "time.sleep(float(sys.argv[2])); "
           "u.urlopen(u.Request(sys.argv[1] + '/_control/restart', data=b'', method='POST'), timeout=5)")


def config(tmp_path: Path, url: str, hooks: list[str], delay: float = 0.0, restart: str = "", extra: str = "",
           sink_timeout: float = 30) -> Path:
    sinks = "".join(f'[[alerts.sinks]]\nkind = "webhook"\nname = "hook{i}"\nurl = {json.dumps(h)}\n'
                    f'secret_env = "ACT_SECRET"\ntimeout = {sink_timeout}\n' for i, h in enumerate(hooks))
    argv = json.dumps([sys.executable, "-c", RESTART, url, str(delay), str(tmp_path / "restart-began")])
    p = tmp_path / "act.toml"
    p.write_text(f"""{FAST}[restart]
down_after = 1.0
boot_timeout = 30.0
backoff_initial = 0.5
backoff_max = 1.0
{restart}
[[restart.steps]]
kind = "command"
argv = {argv}
timeout = 20
[alerts]
attempts = 2
retry_for = 5
{extra}
{sinks}""")
    return p


class Daemon:
    def __init__(self, cfg: Path, state: Path, procs: list[subprocess.Popen[str]]) -> None:
        self.cfg, self.state, self.procs = cfg, state, procs
        self.proc: subprocess.Popen[str] | None = None

    def start(self, *extra: str) -> None:
        env = dict(os.environ, ACT_SECRET=SECRET)
        env.pop("NOTIFY_SOCKET", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--config", str(self.cfg),
                                      "--state-dir", str(self.state), *extra], env=env, text=True,
                                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(self.proc)

    def stop(self) -> str:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=20)
        assert self.proc.returncode == 0, err
        return err

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        path = self.state / "events.jsonl"
        if not path.exists():
            return []
        out = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return [e for e in out if name is None or e["event"] == name]

    def wait_event(self, name: str, count: int = 1, timeout: float = 30) -> dict[str, Any]:
        wait_for(lambda: len(self.events(name)) >= count, timeout, f"{count} {name} event(s)")
        return self.events(name)[count - 1]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "watchdog", *args, "--config", str(self.cfg), "--state-dir",
                               str(self.state)], capture_output=True, text=True, timeout=60, check=False,
                              start_new_session=True)


def alert_events(hook: Receiver) -> list[str]:
    return [b["event"] for b in hook.bodies()]


def freeze(model: EngineModel) -> None:
    with model.lock:
        model.running = 3  # work pending, no counter moves
        model.probe = "hang"  # and a generation gets no answer, as from a wedged vLLM


def test_freeze_is_alerted_restarted_and_proven_back(tmp_path: Path, receiver: Callable[..., Receiver],
                                                     daemon_proc: list[subprocess.Popen[str]]) -> None:
    hook = receiver()
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        d = Daemon(config(tmp_path, url, [hook.url + "/hook"]), tmp_path / "state", daemon_proc)
        d.start("--url", url)
        wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
        freeze(model)
        opened = d.wait_event("incident_opened")
        started = d.wait_event("restart_started")
        recovered = d.wait_event("recovered")
        resolved = d.wait_event("resolved")
        assert opened["kind"] == "frozen" and started["attempt"] == 1 and started["budget_left"] == 2
        assert any("/_control/restart" in line for line in started["plan"])
        assert recovered["incident"] == opened["incident"] == resolved["incident"]
        assert model.restarts == 1
        status = d.cli("status", "--json")
        assert status.returncode == 0, status.stderr
        s = json.loads(status.stdout)
        assert s["daemon"] == "running" and s["incident"] is None and s["budget_left"] == 2
        wait_for(lambda: len(hook.received) >= 4, 15, "four alerts")
        d.stop()
    assert alert_events(hook) == ["stall_detected", "restart_started", "recovered", "resolved"]
    for _path, headers, raw in hook.received:
        want = "sha256=" + hmac.new(SECRET.encode(), raw, hashlib.sha256).hexdigest()
        assert headers["X-Watchdog-Signature"] == want
    bodies = hook.bodies()
    assert {b["incident_id"] for b in bodies} == {opened["incident"]}
    assert bodies[2]["details"]["downtime"] > 0 and bodies[3]["resolved"] is True
    assert SECRET not in (tmp_path / "state" / "events.jsonl").read_text()


def test_an_engine_that_freezes_again_spends_the_budget_and_gives_up(
        tmp_path: Path, receiver: Callable[..., Receiver], daemon_proc: list[subprocess.Popen[str]]) -> None:
    hook = receiver()
    with fake_engine(EngineModel(gen=10, prompt=10, after_restart_running=3)) as (url, model):
        d = Daemon(config(tmp_path, url, [hook.url], restart="budget = 2"), tmp_path / "state", daemon_proc)
        d.start("--url", url)
        wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
        freeze(model)
        gave_up = d.wait_event("gave_up", timeout=60)
        assert len(d.events("restart_started")) == 2 and model.restarts == 2
        assert "budget spent" in gave_up["reason"]
        status = json.loads(d.cli("status", "--json").stdout)
        assert status["gave_up"] and status["budget_left"] == 0
        text = d.cli("status").stdout
        assert "gave up: yes" in text and "0 of 2 left" in text
        # observe only: no third restart while the engine stays frozen
        wait_for(lambda: "gave_up" in alert_events(hook), 15, "the gave_up alert")
        assert model.restarts == 2
        # a human resets: the watchdog acts again
        assert d.cli("reset").returncode == 0
        d.wait_event("restart_started", count=3, timeout=30)
        d.stop()
    events = alert_events(hook)
    assert events.count("gave_up") == 1
    assert events.index("gave_up") > max(i for i, e in enumerate(events) if e == "restart_started" and i < 6)


def test_pause_blocks_restarts_and_alerts_until_resumed(tmp_path: Path, receiver: Callable[..., Receiver],
                                                        daemon_proc: list[subprocess.Popen[str]]) -> None:
    hook = receiver()
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        d = Daemon(config(tmp_path, url, [hook.url]), tmp_path / "state", daemon_proc)
        r = d.cli("pause", "--for", "2h", "--reason", "driver upgrade")
        assert r.returncode == 0 and "paused until" in r.stdout
        d.start("--url", url)
        wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
        freeze(model)
        held = d.wait_event("restart_not_run")
        assert held["choice"] == "paused"
        assert d.wait_event("alert_suppressed")["alert"] == "stall_detected"
        status = json.loads(d.cli("status", "--json").stdout)
        assert status["paused"] is True and status["incident"]["kind"] == "frozen"
        assert "paused: yes" in d.cli("status").stdout
        assert model.restarts == 0 and hook.received == [] and d.events("restart_started") == []
        assert d.cli("resume").stdout.strip() == "resumed"
        d.wait_event("restart_started")
        d.wait_event("resolved")
        d.stop()
    assert model.restarts == 1
    assert alert_events(hook)[:1] == ["restart_started"]  # the stall alert was suppressed while paused


def test_dry_run_alerts_and_describes_but_acts_on_nothing(tmp_path: Path, receiver: Callable[..., Receiver],
                                                          daemon_proc: list[subprocess.Popen[str]]) -> None:
    hook = receiver()
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        d = Daemon(config(tmp_path, url, [hook.url]), tmp_path / "state", daemon_proc)
        d.start("--url", url, "--dry-run")
        wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
        freeze(model)
        described = d.wait_event("restart_not_run")
        assert described["choice"] == "dry_run"
        assert any("/_control/restart" in line for line in described["plan"])
        wait_for(lambda: alert_events(hook) == ["stall_detected"], 15, "the stall alert")
        with model.lock:  # work resumes by itself
            model.gen += 5
            model.running, model.probe = 0, "ok"
        d.wait_event("resolved")
        d.stop()
    assert model.restarts == 0 and d.events("restart_started") == []
    assert alert_events(hook) == ["stall_detected", "resolved"]


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/hook"


def test_down_and_slow_receivers_never_delay_the_restart(tmp_path: Path, receiver: Callable[..., Receiver],
                                                         daemon_proc: list[subprocess.Popen[str]]) -> None:
    """No clock: the slow receiver holds every alert unanswered until the engine has been restarted and proven
    back, so a restart that waited for an alert could not happen at all (its sink's timeout is 10 minutes).
    How long detection -> restart takes with a slow webhook is bench/bench_recovery.py's to measure."""
    answer = threading.Event()

    def held(_n: int) -> tuple[int, float]:
        answer.wait(120)
        return 200, 0.0

    slow = receiver(held)
    try:
        with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
            d = Daemon(config(tmp_path, url, [closed_port(), slow.url], sink_timeout=600), tmp_path / "state",
                       daemon_proc)
            d.start("--url", url)
            wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
            freeze(model)
            opened = d.wait_event("incident_opened")
            wait_for(lambda: slow.hits >= 1, 30, "the stall alert to reach the slow receiver")
            started = d.wait_event("restart_started")
            recovered = d.wait_event("recovered")
            assert slow.received == [] and not answer.is_set()  # still holding the stall alert, unanswered
            assert started["incident"] == recovered["incident"] == opened["incident"]
            answer.set()
            wait_for(lambda: len(slow.received) >= 1, 30, "the slow receiver to answer the first alert")
            err = d.stop()
    finally:
        answer.set()
    assert model.restarts == 1
    assert slow.bodies()[0]["event"] == "stall_detected"
    assert says(line_of(err, "sink hook0", "giving up"), "not delivered", "connection failed"), err


def test_a_watchdog_killed_mid_restart_resumes_without_restarting_twice(
        tmp_path: Path, receiver: Callable[..., Receiver], daemon_proc: list[subprocess.Popen[str]]) -> None:
    hook = receiver()
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        # the restart command takes 3 s: the watchdog is killed while it runs
        d = Daemon(config(tmp_path, url, [hook.url], delay=3.0), tmp_path / "state", daemon_proc)
        d.start("--url", url)
        wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
        freeze(model)
        started = d.wait_event("restart_started")
        wait_for((tmp_path / "restart-began").exists, 10, "the restart command to run")
        assert d.proc is not None
        os.killpg(d.proc.pid, signal.SIGKILL)  # the daemon's own group; the restart command runs in its own session
        d.proc.wait(10)
        memory = json.loads((tmp_path / "state" / "recovery.json").read_text())
        assert memory["incident"]["phase"] == "restarting" and len(memory["restarts"]) == 1
        d.start("--url", url)
        resumed = d.wait_event("incident_resumed")
        recovered = d.wait_event("recovered")
        wait_for(lambda: model.restarts == 1, 10, "the first restart command to finish its work")
        d.stop()
    assert resumed["incident"] == recovered["incident"] == started["incident"]
    assert len(d.events("restart_started")) == 1 and model.restarts == 1
    assert "recovered" in alert_events(hook)
