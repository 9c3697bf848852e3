"""End to end under a real systemd: the real vLLM and the watchdog as units of a throwaway systemd.

A worker is frozen under load; the watchdog captures the stacks, alerts a webhook, restarts vllm.service through
systemctl, proves the engine serves again and resolves the incident. Everything that talks (vLLM, the watchdog,
the alert receiver, the load) runs inside the namespace, whose network has only loopback; the test reads what
happened from the units' files through `ThrowawaySystemd.read_file` and sends signals from the machine.

One vLLM (TP=2, the fast model), booted twice: the test takes about three minutes on 2 cores.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.harness.faults import frozen
from tests.harness.server import BASE_ENV, VllmServer
from tests.harness.systemd_ns import ThrowawaySystemd, available
from tests.harness.watcher import event_time
from watchdog.act.alerts import verify_signature
from watchdog.config.load import Secret

pytestmark = pytest.mark.engine

CHECKOUT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # the project's venv python: the watchdog, the alert sink, the load, the clients
VLLM_PORT = 8000  # on the namespace's own loopback: nothing else listens there
SINK_PORT = 9999
URL = f"http://127.0.0.1:{VLLM_PORT}"
WD_DIR = "/run/wd"
STATE = f"{WD_DIR}/state"
CONFIG = f"{WD_DIR}/watchdog.toml"
ALERTS = "/run/alerts/received.jsonl"
LOAD_PY = "/run/e2e/load.py"
SECRET_ENV = "WD_E2E_WEBHOOK_SECRET"
SECRET = "e2e-webhook-secret-4f1c9a"
BUDGET = 3
MAIN_UNITS = ("vllm.service", "alert-sink.service", "watchdog.service")
ACT_EVENTS = ("incident_opened", "evidence_captured", "restart_started", "recovered", "resolved")
ALERT_EVENTS = ["stall_detected", "evidence_captured", "restart_started", "recovered", "resolved"]

CONFIG_TOML = f"""\
[engine]
url = "{URL}"
name = "vllm"
[scrape]
interval = 0.5
[judge]
suspect_after = 10.0
stall_window = 25.0
[probe]
interval = 5.0
retry = 2.0
timeout = 60.0
[capture]
enabled = true
gap = 2.0
journal_unit = "vllm.service"
[exporter]
port = 0
[state]
trace_max_bytes = 0
[restart]
boot_timeout = 400.0
evidence_timeout = 120.0
budget = {BUDGET}
backoff_initial = 60.0
[[restart.steps]]
kind = "systemd"
action = "restart"
units = ["vllm.service"]
timeout = 120.0
[alerts]
attempts = 5
retry_for = 60.0
[[alerts.sinks]]
kind = "webhook"
name = "e2e-sink"
url = "http://127.0.0.1:{SINK_PORT}/hook"
secret_env = "{SECRET_ENV}"
timeout = 10.0
"""

# Four streams of long generations, over and over, until the unit is stopped: work is always pending.
LOAD_SCRIPT = """\
import json, sys, threading, time, urllib.request

def stream(i):
    body = json.dumps({"model": sys.argv[2], "prompt": f"load {i}: the quick brown fox", "max_tokens": 2000,
                       "ignore_eos": True, "temperature": 1.0}).encode()
    while True:
        req = urllib.request.Request(sys.argv[1] + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
        except Exception as e:
            print(f"stream {i}: {type(e).__name__}: {e}", flush=True)
            time.sleep(0.5)

for i in range(4):
    threading.Thread(target=stream, args=(i,), daemon=True).start()
print("load running", flush=True)
while True:
    time.sleep(3600)
"""

# One real completion (max_tokens=1); exit status 0 and the JSON answer on stdout when it succeeded.
COMPLETE = """\
import json, sys, urllib.request
body = json.dumps({"model": sys.argv[2], "prompt": "ready", "max_tokens": 1}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=float(sys.argv[3])) as r:
    print(json.dumps(json.load(r)))
"""


def _arg(value: str) -> str:
    """One ExecStart= argument, quoted: no specifier (%) or variable ($) expansion, no word splitting."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def _exec(argv: list[str]) -> str:
    return " ".join(_arg(a) for a in argv)


def _environment(env: dict[str, str]) -> str:
    return "".join(
        'Environment="' + f"{k}={v}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"\n'
        for k, v in env.items()
    )


def units(vllm_argv: list[str], model_name: str) -> dict[str, str]:
    vllm_env = {**BASE_ENV, "HOME": str(Path.home())}
    sink_argv = [PYTHON, str(CHECKOUT / "tests/harness/alert_sink_main.py"), "--port", str(SINK_PORT), "--out", ALERTS]
    return {
        "vllm.service": (
            "[Unit]\nDescription=vLLM under test (CPU, TP=2)\n[Service]\nType=exec\n"
            f"ExecStart={_exec(vllm_argv)}\nWorkingDirectory=/tmp\n{_environment(vllm_env)}"
            "TimeoutStopSec=30\nKillMode=control-group\n"
        ),
        "alert-sink.service": (
            "[Unit]\nDescription=webhook receiver under test\n[Service]\nType=notify\nNotifyAccess=main\n"
            f"ExecStart={_exec(sink_argv)}\n"
        ),
        "watchdog.service": (
            "[Unit]\nDescription=engine-watchdog under test\nAfter=vllm.service alert-sink.service\n"
            "[Service]\nType=notify\nNotifyAccess=main\nWatchdogSec=60\n"
            f"ExecStart={_exec([PYTHON, '-m', 'watchdog', 'run', '--config', CONFIG, '--state-dir', STATE])}\n"
            f"WorkingDirectory={CHECKOUT}\n{_environment({SECRET_ENV: SECRET})}TimeoutStopSec=20\n"
        ),
        "load.service": (  # started on demand
            "[Unit]\nDescription=load on the vLLM under test\n[Service]\nType=exec\n"
            f"ExecStart={_exec([PYTHON, LOAD_PY, URL, model_name])}\n"
        ),
    }


# ----------------------------------------------------------------------------- reading what happened inside


def read_jsonl(sd: ThrowawaySystemd, path: str) -> list[dict[str, Any]]:
    r = sd.run(["cat", path], timeout=30)
    if r.returncode != 0:
        return []
    out = []
    for line in r.stdout.splitlines():
        with contextlib.suppress(ValueError):  # a line being written as we read
            out.append(json.loads(line))
    return out


def events(sd: ThrowawaySystemd, name: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(sd, f"{STATE}/events.jsonl") if name is None or e.get("event") == name]


def wait_for(what: str, timeout: float, check: Callable[[], Any], sd: ThrowawaySystemd, every: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy; fail early when a main unit failed."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        failed = [u for u in MAIN_UNITS if sd.active_state(u) == "failed"]
        if failed:
            raise AssertionError(f"waiting for {what}: {', '.join(failed)} failed")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f}s")
        time.sleep(every)


def transition_to(sd: ThrowawaySystemd, state: str, after: float = 0.0) -> dict[str, Any] | None:
    return next((e for e in events(sd, "transition")
                 if e["engine"] == "0" and e["to"] == state and event_time(e) >= after), None)


def complete(sd: ThrowawaySystemd, model: str, timeout: float = 60.0) -> dict[str, Any] | None:
    r = sd.run([PYTHON, "-c", COMPLETE, URL, model, str(timeout)], timeout=timeout + 15)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def worker(sd: ThrowawaySystemd, title: str) -> psutil.Process:
    """An engine process of vllm.service by its title, as a process of the machine (for signals from here)."""
    root = psutil.Process(sd.host_pid(sd.main_pid("vllm.service")))
    found = []
    for p in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = p.cmdline()
            if cmdline and cmdline[0].strip() == title:
                return p
            found.append(cmdline[0].strip() if cmdline else "?")
    raise AssertionError(f"no {title} under vllm.service (pid {root.pid}); found {found}")


def diagnose(sd: ThrowawaySystemd) -> None:
    for unit in (*MAIN_UNITS, "load.service"):
        with contextlib.suppress(Exception):
            print(f"--- {unit}: {sd.active_state(unit)}; journal tail ---\n{sd.journal(unit, lines=80)}")
    with contextlib.suppress(Exception):
        print("--- watchdog events ---")
        for e in events(sd):
            print(json.dumps(e))
    with contextlib.suppress(Exception):
        print(f"--- alerts received ---\n{sd.run(['cat', ALERTS], timeout=10).stdout}")


@contextlib.contextmanager
def diagnosed(sd: ThrowawaySystemd) -> Iterator[None]:
    try:
        yield
    except BaseException:
        diagnose(sd)
        raise


# ----------------------------------------------------------------------------- the test


def test_frozen_worker_is_captured_restarted_through_systemctl_and_serves_again(
        engine_python: Path, fast_model: Path, tmp_path: Path) -> None:
    reason = available()
    if reason is not None:
        pytest.fail(f"a throwaway systemd cannot run on this machine: {reason}")
    began = time.monotonic()
    server = VllmServer(engine_python, fast_model, tmp_path, port=VLLM_PORT)  # for its command line only
    model = server.model_name
    sd = ThrowawaySystemd(
        "e2e-recovery",
        units(server.args, model),
        wanted=list(MAIN_UNITS),
        files={CONFIG: CONFIG_TOML, LOAD_PY: LOAD_SCRIPT},
        log_dir=tmp_path / "systemd",
    )
    with sd, diagnosed(sd):
        # 1. vLLM serves, the watchdog is up (Type=notify: active once it sent READY=1) and sees the engine idle
        ready = wait_for("a first completion", 300, lambda: complete(sd, model, timeout=30), sd, every=1.0)
        assert ready["usage"]["completion_tokens"] == 1, ready
        booted = time.monotonic() - began
        sd.wait_active("alert-sink.service", timeout=30)
        sd.wait_active("watchdog.service", timeout=60)
        wait_for("engine 0 idle", 120, lambda: transition_to(sd, "idle"), sd)
        first_pid = sd.main_pid("vllm.service")

        # 2. load, then freeze one worker rank until the watchdog has issued the restart
        load_started = time.time()
        sd.systemctl("start", "load.service", timeout=30)
        wait_for("engine 0 working under load", 60, lambda: transition_to(sd, "working", after=load_started), sd)
        time.sleep(3)
        tp1 = worker(sd, "VLLM::Worker_TP1")
        with frozen(tp1):
            stopped_at = time.time()
            started = wait_for("restart_started", 240, lambda: events(sd, "restart_started"), sd)[0]
        sd.systemctl("stop", "load.service", timeout=30)

        # 3. recovered and resolved; the alerts all arrived
        resolved = wait_for("resolved", 420, lambda: events(sd, "resolved"), sd, every=1.0)[0]
        received = wait_for("five alerts", 60, lambda: (a := read_jsonl(sd, ALERTS)) and len(a) >= 5 and a, sd)
        after = complete(sd, model)
        status_run = sd.run([PYTHON, "-m", "watchdog", "status", "--json", "--config", CONFIG, "--state-dir", STATE],
                            timeout=60)
        second_pid = sd.main_pid("vllm.service")
        all_events = events(sd)

        # the act stage, in order, for one incident
        acts = [e for e in all_events if e["event"] in ACT_EVENTS]
        assert [e["event"] for e in acts] == list(ACT_EVENTS), acts
        opened, captured, _, recovered, _ = acts
        assert {e["incident"] for e in acts if "incident" in e} == {opened["incident"]}
        assert opened["kind"] == "frozen" and opened["engine"] == "0", opened
        assert started["attempt"] == 1 and started["budget_left"] == BUDGET - 1, started
        assert any("systemctl --no-ask-password restart -- vllm.service" in line for line in started["plan"]), started
        assert resolved["how"] == "recovered", resolved
        assert not events(sd, "restart_failed") and not events(sd, "gave_up")
        assert SECRET not in sd.read_file(f"{STATE}/events.jsonl")

        # the evidence: a complete bundle with every rank's stacks, the frozen rank named, the unit's journal
        assert captured["culprit"] == "Worker_TP1" and captured["decision"] == "stuck", captured
        bundle = captured["bundle"]
        assert bundle and bundle.startswith(f"{STATE}/incidents/"), captured
        manifest = json.loads(sd.read_file(f"{bundle}/manifest.json"))
        procs = {p["title"].split(" ", 1)[0]: p for p in manifest["processes"] if p["title"]}
        assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(procs), sorted(procs)
        assert procs["VLLM::Worker_TP1"]["state"] == "T" and procs["VLLM::Worker_TP1"]["frames"], procs
        assert procs["VLLM::Worker_TP0"]["frames"], procs
        assert "Worker_TP1" in sd.read_file(f"{bundle}/summary.md")
        dumps = sd.run(["ls", f"{bundle}/dumps"], timeout=30, check=True).stdout.split()
        assert any("Worker_TP1" in d for d in dumps), dumps
        assert "vllm" in sd.read_file(f"{bundle}/log-tail.txt").lower()  # journalctl -u vllm.service, inside

        # systemd restarted the unit: a new main process, the frozen rank gone with the old one; it serves
        assert second_pid not in (0, first_pid), (first_pid, second_pid)
        assert sd.is_active("vllm.service") and sd.is_active("watchdog.service")
        assert sd.show("watchdog.service", "NRestarts") == "0"
        # sd_notify: STATUS= from every pass reaches systemd (READY=1 did: Type=notify went active)
        assert "engine 0: " in sd.show("watchdog.service", "StatusText")
        assert not tp1.is_running()
        assert after is not None and after["usage"]["completion_tokens"] == 1, after

        # the webhook: five signed alerts for the incident, in order
        bodies = [base64.b64decode(a["body_b64"]) for a in received]
        alerts = [json.loads(b) for b in bodies]
        assert [a["event"] for a in alerts] == ALERT_EVENTS, alerts
        for record, raw in zip(received, bodies, strict=True):
            headers = {k.lower(): v for k, v in record["headers"].items()}
            assert record["path"] == "/hook"
            assert headers["content-type"] == "application/json"
            assert verify_signature(Secret(SECRET), raw, headers["x-watchdog-signature"]), record
        assert {a["incident_id"] for a in alerts} == {opened["incident"]}
        assert alerts[1]["details"]["bundle"] == bundle and alerts[3]["details"]["downtime"] > 0
        assert alerts[-1]["resolved"] is True

        # `watchdog status`, run inside: nothing open, one restart spent
        assert status_run.returncode == 0, status_run.stderr
        status = json.loads(status_run.stdout)
        assert status["daemon"] == "running" and status["incident"] is None, status
        assert status["budget"] == BUDGET and status["budget_left"] == BUDGET - 1, status

        frozen_tr = next(e for e in all_events if e["event"] == "transition" and e["to"] == "frozen")
        print(f"\nboot to first completion {booted:.0f}s; SIGSTOP -> frozen "
              f"{event_time(frozen_tr) - stopped_at:.1f}s ({frozen_tr['reason']}); incident_opened -> "
              f"restart_started {event_time(started) - event_time(opened):.1f}s; restart_started -> recovered "
              f"{event_time(recovered) - event_time(started):.1f}s; test {time.monotonic() - began:.0f}s so far")
