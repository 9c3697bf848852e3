"""Two engines on one host, one watchdog each: the shipped template unit (``engine-watchdog@.service``, as the
installer makes it from ``systemd/engine-watchdog.service``: `shipped_unit.template_for_test`), instances ``a`` and
``b``, each with its own config (URL, engine name, exporter port, restart step), state directory
(``StateDirectory=engine-watchdog/%i``) and incident ids, under a throwaway systemd with two real CPU vLLMs as
units (TP=1 each: two engines and their load on 2 cores).

vllm-a's EngineCore is stopped under load on both: instance a calls it frozen, restarts vllm-a.service only and
proves it serves; instance b sees its engine work on and never opens an incident; vllm-b is never restarted (the
same main process, NRestarts 0).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.engine.test_systemd_e2e import COMPLETE, LOAD_SCRIPT, PYTHON, _environment, _exec, read_jsonl
from tests.harness.faults import frozen
from tests.harness.server import BASE_ENV, VllmServer
from tests.harness.shipped_unit import CONFIG_DIR, TEMPLATE, shipped_systemd, template_for_test
from tests.harness.systemd_ns import ThrowawaySystemd
from tests.harness.watcher import event_time

pytestmark = pytest.mark.engine

NAMES = ("a", "b")
PORT = {"a": 8001, "b": 8002}  # on the namespace's own loopback
EXPORTER = {"a": 9101, "b": 9102}
LOAD_PY = "/run/two-engines/load.py"


def url(name: str) -> str:
    return f"http://127.0.0.1:{PORT[name]}"


def config(name: str) -> str:
    return f"""\
[engine]
url = "{url(name)}"
name = "vllm-{name}"
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
gap = 2.0
journal_unit = "vllm-{name}.service"
[exporter]
port = {EXPORTER[name]}
[state]
trace_max_bytes = 0
[restart]
boot_timeout = 400.0
evidence_timeout = 120.0
budget = 2
[[restart.steps]]
kind = "systemd"
action = "restart"
units = ["vllm-{name}.service"]
timeout = 120.0
"""


def units(argv: dict[str, list[str]], model: str) -> dict[str, str]:
    env = _environment({**BASE_ENV, "HOME": str(Path.home())})
    out = {TEMPLATE: template_for_test()}
    for name in NAMES:
        out[f"vllm-{name}.service"] = (f"[Unit]\nDescription=vLLM {name} under test (CPU, TP=1)\n[Service]\n"
                                       f"Type=exec\nExecStart={_exec(argv[name])}\nWorkingDirectory=/tmp\n{env}"
                                       "TimeoutStopSec=30\nKillMode=control-group\n")
        out[f"load-{name}.service"] = (f"[Unit]\nDescription=load on vLLM {name}\n[Service]\nType=exec\n"
                                       f"ExecStart={_exec([PYTHON, LOAD_PY, url(name), model])}\n")
    return out


def events(sd: ThrowawaySystemd, name: str, event: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(sd, f"/var/lib/engine-watchdog/{name}/events.jsonl")
            if event is None or e.get("event") == event]


def transition(sd: ThrowawaySystemd, name: str, state: str, after: float = 0.0) -> dict[str, Any] | None:
    return next((e for e in events(sd, name, "transition") if e["to"] == state and event_time(e) >= after), None)


def wait_for(what: str, timeout: float, check: Any, sd: ThrowawaySystemd, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if found := check():
            return found
        failed = [u for u in (*(f"vllm-{n}.service" for n in NAMES), *(f"engine-watchdog@{n}.service" for n in NAMES))
                  if sd.active_state(u) == "failed"]
        if failed or time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f}s" + (f"; failed: {failed}" if failed else ""))
        time.sleep(every)


def complete(sd: ThrowawaySystemd, name: str, model: str) -> dict[str, Any] | None:
    r = sd.run([PYTHON, "-c", COMPLETE, url(name), model, "30"], timeout=45)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None


def engine_core(sd: ThrowawaySystemd, name: str) -> psutil.Process:
    root = psutil.Process(sd.host_pid(sd.main_pid(f"vllm-{name}.service")))
    for p in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.cmdline() and p.cmdline()[0].strip() == "VLLM::EngineCore":
                return p
    raise AssertionError(f"no VLLM::EngineCore under vllm-{name}.service")


@contextlib.contextmanager
def diagnosed(sd: ThrowawaySystemd) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for unit in (*(f"vllm-{n}.service" for n in NAMES), *(f"engine-watchdog@{n}.service" for n in NAMES)):
            with contextlib.suppress(Exception):
                print(f"--- {unit}: {sd.active_state(unit)} ---\n{sd.journal(unit, lines=60)}")
        for name in NAMES:
            with contextlib.suppress(Exception):
                print(f"--- events of instance {name} ---\n" + "\n".join(json.dumps(e) for e in events(sd, name)))
        raise


def test_two_engines_one_watchdog_each_one_frozen_and_restarted_the_other_untouched(
        engine_python: Path, fast_model: Path, tmp_path: Path) -> None:
    argv = {n: VllmServer(engine_python, fast_model, tmp_path, port=PORT[n], tensor_parallel_size=1).args
            for n in NAMES}
    model = fast_model.name
    sd = shipped_systemd("two-engines", tmp_path / "systemd", "", units=units(argv, model),
                         files={**{f"{CONFIG_DIR}/{n}.toml": config(n) for n in NAMES}, LOAD_PY: LOAD_SCRIPT},
                         wanted=[f"vllm-{n}.service" for n in NAMES])
    with sd, diagnosed(sd):
        for name in NAMES:
            wait_for(f"a first completion from vllm-{name}", 400, lambda n=name: complete(sd, n, model), sd, 1.0)
        sd.systemctl("start", *(f"engine-watchdog@{n}.service" for n in NAMES), timeout=60)
        for name in NAMES:
            sd.wait_active(f"engine-watchdog@{name}.service", timeout=60)
            wait_for(f"instance {name}: idle", 120, lambda n=name: transition(sd, n, "idle"), sd)
        pids = {n: sd.main_pid(f"vllm-{n}.service") for n in NAMES}
        began = time.time()
        sd.systemctl("start", *(f"load-{n}.service" for n in NAMES), timeout=30)
        for name in NAMES:
            wait_for(f"instance {name}: working", 90, lambda n=name: transition(sd, n, "working", began), sd)
        time.sleep(3)
        with frozen(engine_core(sd, "a")):
            stopped = time.time()
            started = wait_for("instance a: restart_started", 240, lambda: events(sd, "a", "restart_started"), sd)[0]
        resolved = wait_for("instance a: resolved", 420, lambda: events(sd, "a", "resolved"), sd, 1.0)[0]
        time.sleep(5)  # instance b watched on past the restart of a
        sd.systemctl("stop", *(f"load-{n}.service" for n in NAMES), timeout=30)
        exporters = {n: sd.run([PYTHON, "-c", "import sys, urllib.request; print(urllib.request.urlopen("
                                f"'http://127.0.0.1:{EXPORTER[n]}/metrics', timeout=10).read().decode())"],
                               timeout=30).stdout for n in NAMES}
        a, b = events(sd, "a"), events(sd, "b")
        after = {n: sd.main_pid(f"vllm-{n}.service") for n in NAMES}
        restarts_b = sd.show("vllm-b.service", "NRestarts")

    opened = [e for e in a if e["event"] == "incident_opened"]
    captured = next(e for e in a if e["event"] == "evidence_captured")
    print(f"vllm-a's EngineCore stopped -> instance a: {opened[0]['kind']} {event_time(opened[0]) - stopped:.1f}s, "
          f"restart {event_time(started) - stopped:.1f}s, resolved {event_time(resolved) - stopped:.1f}s; "
          f"culprit {captured['culprit']}; incident {opened[0]['incident']}")
    assert len(opened) == 1 and opened[0]["kind"] == "frozen", opened
    assert "vllm-a" in opened[0]["incident"] and captured["culprit"] == "EngineCore", (opened, captured)
    assert [line for line in started["plan"] if "systemctl" in line] == [
        next(line for line in started["plan"] if "restart -- vllm-a.service" in line)], started["plan"]
    assert resolved["how"] == "recovered" and captured["bundle"].startswith("/var/lib/engine-watchdog/a/"), resolved
    assert after["a"] != pids["a"]  # restarted
    # the other engine: working through, never suspected, never an incident, never restarted
    assert not [e for e in b if e["event"] in ("incident_opened", "restart_started", "stall_detected")], b
    assert not [e for e in b if e["event"] == "transition" and e["to"] in ("suspect", "frozen")
                and event_time(e) >= began], b
    assert after["b"] == pids["b"] and restarts_b == "0", (pids, after, restarts_b)
    assert 'stack="vllm-a"' in exporters["a"] and 'stack="vllm-b"' in exporters["b"], exporters
