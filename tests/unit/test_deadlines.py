"""The deadline the evidence races: the pure report (tables) and the reading of a real child process's environment
and command line (its own session, killed in teardown)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.facts import line_of, says
from watchdog.act.state import save_status
from watchdog.cli.act import cmd_status
from watchdog.config.load import CaptureSection, Config, JudgeSection, StateSection
from watchdog.core.processes import EngineProcess
from watchdog.core.roles import Role
from watchdog.evidence.collect.deadline_read import config_confirm_seconds, read_deadlines, read_settings
from watchdog.evidence.collect.deadlines import ProcessSettings, confirm_seconds, lines, report


def proc(env: dict[str, str] | None = None, argv: list[str] | None = None, pid: int = 10,
         label: str = "VLLM::EngineCore") -> ProcessSettings:
    return ProcessSettings(pid, label, env or {}, argv or [])


@pytest.mark.parametrize(("suspect", "window", "interval", "rounds", "gap", "timeout", "expected"), [
    (15, 40, 1, 2, 3, 10, 15 + 1 + 2 * 2 * 10 + 3),  # the defaults: 59 s, the capture outlasts the window
    (15, 120, 1, 2, 3, 10, 121),  # a long window: the metric window decides last
    (5, 10, 2, 1, 3, 4, max(5 + 2 + 8, 12)),  # one round: no gap
    (30, 30, 1, 3, 5, 2, 30 + 1 + 3 * 4 + 2 * 5),
])
def test_confirm_seconds(suspect: float, window: float, interval: float, rounds: int, gap: float, timeout: float,
                         expected: float) -> None:
    assert confirm_seconds(suspect, window, interval, rounds, gap, timeout) == expected


@pytest.mark.parametrize(("procs", "earliest", "seconds", "where"), [
    ([], "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0, "vLLM's default"),
    ([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800"})], "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 1800.0,
     "environment of pid 10"),
    ([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800"}, ["vllm", "serve", "--distributed-timeout-seconds", "600"])],
     "--distributed-timeout-seconds", 600.0, "command line of pid 10"),
    ([proc({}, ["vllm", "serve", "--distributed-timeout-seconds=90"])], "--distributed-timeout-seconds", 90.0,
     "command line"),
    ([proc({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "120"})], "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", 120.0, "environment"),
    ([proc({"VLLM_ENGINE_ITERATION_TIMEOUT_S": "60"})], "VLLM_ENGINE_ITERATION_TIMEOUT_S", 60.0, "environment"),
    ([proc({}, ["python", "-m", "sglang.launch_server", "--watchdog-timeout", "200"])], "--watchdog-timeout", 200.0,
     "command line"),
    # the smallest value wins where the processes differ
    ([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "900"}),
      proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "400"}, pid=11, label="VLLM::Worker_TP1")],
     "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 400.0, "pid 11 (VLLM::Worker_TP1)"),
    # VLLM_RPC_TIMEOUT is reported (in ms) but is no step timeout: the default execute-model timeout stays earliest
    ([proc({"VLLM_RPC_TIMEOUT": "10000"})], "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0, "default"),
    # with async error handling off and no blocking wait, a process-group timeout kills nothing
    ([proc({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, ["x", "--distributed-timeout-seconds", "60"])],
     "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0, "default"),
    ([proc({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "1"},
           ["x", "--distributed-timeout-seconds", "60"])], "--distributed-timeout-seconds", 60.0, "command line"),
    # a value that is no number is shown, never counted
    ([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "soon"})], None, None, ""),
])
def test_earliest_deadline(procs: list[ProcessSettings], earliest: str | None, seconds: float | None,
                           where: str) -> None:
    r = report(procs, 60.0)
    if earliest is None:
        assert r.earliest is None and r.ok and r.warning == ""
        return
    assert r.earliest is not None
    assert (r.earliest.name, r.earliest.seconds) == (earliest, seconds)
    assert where in r.earliest.where


@pytest.mark.parametrize(("confirm", "deadline", "warned"), [
    (59.0, "300", False),  # the defaults against vLLM's default: 59 <= 150
    (150.0, "300", False),  # exactly half: inside
    (151.0, "300", True),
    (43.0, "80", True),  # 43 > 40
    (43.0, "86", False),
])
def test_warning_at_half_the_deadline(confirm: float, deadline: str, warned: bool) -> None:
    r = report([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": deadline})], confirm)
    assert r.ok is not warned
    if warned:
        assert says(r.warning, f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS={deadline}", "environment", "pid 10",
                    "VLLM::EngineCore", f"{confirm:.0f}s"), r.warning
    else:
        assert r.warning == ""


def test_as_dict_and_status_lines() -> None:
    r = report([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60", "VLLM_RPC_TIMEOUT": "20000", "API_KEY": "secret"}),
                ProcessSettings(12, "VLLM::Worker_TP0", {}, [], "its environment cannot be read")], 43.0)
    d = r.as_dict()
    assert d["ok"] is False and d["earliest"]["seconds"] == 60.0 and d["confirm_seconds"] == 43.0
    assert {s["name"]: s["seconds"] for s in d["settings"]} == {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": 60.0,
                                                                "VLLM_RPC_TIMEOUT": 20.0}
    assert "secret" not in str(d)
    out = lines(d)
    assert out[0].startswith("deadline: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS") and "TOO LATE" in out[0]
    assert out[1].startswith("WARNING: ") and any("pid 12" in line for line in out)
    assert lines(report([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "x"})], 43.0).as_dict())[0].startswith(
        "deadline: none known")


# -- reading a real process ------------------------------------------------------------------------------------


@pytest.fixture
def engine_like() -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "70", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900",
           "SOME_TOKEN": "must-not-leave"}
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(60)",
                          "--distributed-timeout-seconds", "1200"], env=env, stdout=subprocess.PIPE,
                         start_new_session=True)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    yield p
    p.kill()
    p.wait(timeout=10)
    p.stdout.close()


def test_read_a_real_process(engine_like: subprocess.Popen[bytes]) -> None:
    cfg = Config()
    engine = EngineProcess(engine_like.pid, Role.ENGINE_CORE, "VLLM::EngineCore")
    [got] = read_settings([engine])
    assert got.error == "" and got.env == {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "70",
                                           "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}
    r = read_deadlines(cfg, "http://127.0.0.1:9", [engine])
    assert r.earliest is not None and r.earliest.name == "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
    assert r.earliest.seconds == 70.0 and f"pid {engine_like.pid}" in r.earliest.where
    assert r.confirm_seconds == config_confirm_seconds(cfg) == 48.0  # defaults: 5 + 1 + 2*2*10 + 2
    assert not r.ok and "70s" in r.warning  # 48 s does not fit in half of 70 s
    assert {s.name: s.seconds for s in r.settings}["--distributed-timeout-seconds"] == 1200.0
    # a tighter judge and capture fit: 5 + 1 + 2*2*2 + 3 = 17 <= 35
    fast = Config(judge=JudgeSection(suspect_after=5.0, stall_window=10.0), capture=CaptureSection(timeout=2.0))
    assert read_deadlines(fast, "http://127.0.0.1:9", [engine]).ok
    assert "must-not-leave" not in str(r.as_dict())


def test_read_a_process_that_is_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait(timeout=10)
    [got] = read_settings([EngineProcess(p.pid, Role.WORKER, "VLLM::Worker_TP1")])
    assert says(got.error, "exited") and got.env == {}
    r = report([got], 43.0)
    assert len(r.problems) == 1 and says(r.problems[0], f"pid {p.pid}", "VLLM::Worker_TP1", "exited"), r.problems
    assert r.earliest is not None and r.earliest.where.startswith("vLLM's default")


def test_status_shows_the_deadlines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path
    d = report([proc({"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60"})], 43.0).as_dict()
    save_status(state, {"time": time.time(), "interval": 1.0, "engines": [], "deadlines": d})
    cmd_status(Config(state=StateSection(dir=str(state))), argparse.Namespace(json=False))
    out = capsys.readouterr().out
    assert says(line_of(out, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"), "deadline", "environment", "pid 10",
                "VLLM::EngineCore", "60s"), out
    assert says(line_of(out, "WARNING"), "43s"), out
