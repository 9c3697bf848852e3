"""The command and the service, end to end against a small fake server; systemd notify on a real socket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

import watchdog
from tests.fakes import FAST, EngineModel, fake_engine, wait_for
from tests.receiver import Receiver
from watchdog.act.alerts import Alert, WebhookSink
from watchdog.cli.main import clashing_distribution
from watchdog.evidence.collect.context import engine_versions
from watchdog.scrape.engine_http import EngineHTTP

CHECKOUT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", *args], capture_output=True, text=True,
                          timeout=timeout, start_new_session=True, check=False)


@pytest.fixture
def fast_config(tmp_path: Path) -> Path:
    p = tmp_path / "fast.toml"
    p.write_text(FAST)
    return p


def test_check_idle_engine_exits_0_after_the_probe(fast_config: Path) -> None:
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        r = run_cli("check", "--url", url, "--config", str(fast_config), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["engines"][0]["engine"] == "0"
    assert out["engines"][0]["state"] == "idle"
    assert model.probes >= 1


def test_check_frozen_engine_exits_1(fast_config: Path) -> None:
    with fake_engine(EngineModel(running=4, gen=100, prompt=50)) as (url, _):
        r = run_cli("check", "--url", url, "--config", str(fast_config), "--seconds", "4")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FROZEN" in r.stdout and "running=4" in r.stdout


def test_check_short_look_at_a_busy_engine_without_progress_is_not_healthy(fast_config: Path) -> None:
    with fake_engine(EngineModel(running=4, gen=100)) as (url, _):
        r = run_cli("check", "--url", url, "--seconds", "1.5", "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    eng = json.loads(r.stdout)["engines"][0]
    assert eng["state"] == "suspect" and "watch longer" in eng["reason"]


def test_check_refused_exits_2() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = run_cli("check", "--url", f"http://127.0.0.1:{port}", "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["engines"][0]["state"] == "down"


def test_check_blind_exits_3_and_bad_config_names_the_key(tmp_path: Path) -> None:
    with fake_engine() as (url, _):
        r = run_cli("check", "--url", url + "/nothing-here")
    assert r.returncode == 3 and "BLIND" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[judge]\nstall_windw = 3\n")
    r = run_cli("check", "--config", str(bad))
    assert r.returncode == 64 and "judge.stall_windw" in r.stderr


def test_run_writes_transitions_and_stops_cleanly_on_sigterm(tmp_path: Path, fast_config: Path,
                                                            daemon_proc: list[subprocess.Popen[str]]) -> None:
    state = tmp_path / "state"
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(30)
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        env = dict(os.environ, NOTIFY_SOCKET=str(notify), WATCHDOG_USEC="1000000")  # a ping every 0.5 s
        p = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--url", url, "--state-dir", str(state),
                              "--config", str(fast_config)], env=env, text=True, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        daemon_proc.append(p)
        first = sock.recv(4096).decode()
        assert "READY=1" in first
        events = state / "events.jsonl"
        wait_for(lambda: events.exists() and '"to": "idle"' in events.read_text(), 30, "idle")
        with model.lock:
            model.running = 3  # work pending, nothing moves
        wait_for(lambda: '"to": "frozen"' in events.read_text(), 30, "frozen")
        said = [first]  # the status line when it changes, the watchdog ping when it is due
        while not any("STATUS=engine 0: frozen" in m for m in said):
            said.append(sock.recv(4096).decode())
        pings = [sock.recv(4096).decode() for _ in range(3)]  # frozen holds: pings go on
        assert all("WATCHDOG=1" in m for m in pings), pings
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=10)
        assert p.returncode == 0, err
        tail = sock.recv(4096).decode()
        while "STOPPING=1" not in tail:
            tail = sock.recv(4096).decode()
    lines = [e for x in events.read_text().splitlines() if (e := json.loads(x))["event"] == "transition"]
    # (a slow machine may skip `working` and go straight to `suspect`: the thresholds here are 1 s and 2 s)
    assert [(e["from"], e["to"]) for e in lines][:2] == [(None, "starting"), ("starting", "idle")]
    frozen = next(e for e in lines if e["to"] == "frozen")
    assert {"time", "engine", "from", "to", "reason"} <= frozen.keys() and frozen["engine"] == "0"
    trace = (state / "trace.jsonl").read_text().splitlines()
    assert json.loads(trace[0])["kind"] == "header" and len(trace) > 5
    assert "stopped by SIGTERM" in err


def test_run_exports_its_own_metrics(tmp_path: Path, daemon_proc: list[subprocess.Popen[str]]) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with fake_engine(EngineModel(gen=1)) as (url, _):
        p = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--url", url, "--state-dir", str(tmp_path),
                              "--metrics-port", str(port)], text=True, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        daemon_proc.append(p)

        def scraped() -> bool:
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except requests.RequestException:
                return False
            return 'watchdog_engine_state{engine="0",state="idle"} 1.0' in text

        wait_for(scraped, 15, "the exporter to show engine 0 idle")
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        assert "watchdog_scrapes_total" in text and 'watchdog_probes_total{result="ok"}' in text
        assert "watchdog_transitions_total" in text and "watchdog_engine_seconds_since_progress" in text
        p.send_signal(signal.SIGINT)
        assert p.wait(10) == 0


def test_run_once_needs_no_config(tmp_path: Path) -> None:
    with fake_engine(EngineModel(gen=3)) as (url, _):
        r = run_cli("run", "--once", "--url", url, "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    events = [json.loads(x) for x in (tmp_path / "s" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["to"] == "idle"


def test_record_then_replay_under_other_thresholds(tmp_path: Path, fast_config: Path) -> None:
    trace = tmp_path / "t.jsonl"
    with fake_engine(EngineModel(running=2, gen=5, prompt=5)) as (url, _):
        r = run_cli("record", "--url", url, "--config", str(fast_config), "--seconds", "3", "--out", str(trace))
    assert r.returncode == 0, r.stderr
    r = run_cli("replay", str(trace), "--config", str(fast_config))
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["to"] for x in r.stdout.splitlines()] == ["working", "suspect", "frozen"]
    lenient = tmp_path / "lenient.toml"
    lenient.write_text("[judge]\nsuspect_after = 60\nstall_window = 120\n")
    r = run_cli("replay", str(trace), "--config", str(lenient))
    assert [json.loads(x)["to"] for x in r.stdout.splitlines()] == ["working"]


def test_replay_of_a_broken_trace_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "header", "version": 1}\n{"kind": "scrape", "t": 1\n')
    r = run_cli("replay", str(bad))
    assert r.returncode == 64 and "bad.jsonl:2" in r.stderr


def test_the_unrelated_watchdog_package_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert clashing_distribution() is None
    info = tmp_path / "watchdog-7.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: watchdog\nVersion: 7.1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert clashing_distribution() == "watchdog 7.1.0"


def test_run_with_an_unusable_state_dir_says_so(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = run_cli("run", "--once", "--url", "http://127.0.0.1:9", "--state-dir", str(blocker / "state"))
    assert r.returncode == 74
    assert "Not a directory" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- exit codes: usage 64, a bug 70

# a real `watchdog` process with a bug planted in one command: it raises ValueError from deep inside
PLANTED_BUG = """
import sys
import watchdog.cli.main as cli
import watchdog.cli.service as commands
def replay_with_a_bug(trace, thresholds):
    return int("not a number")
commands.replay = replay_with_a_bug
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_bug_is_exit_70_with_its_traceback_never_bad_config(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"kind": "header", "version": 1}\n')
    r = subprocess.run([sys.executable, "-c", PLANTED_BUG, "replay", str(trace)], capture_output=True, text=True,
                       timeout=60, start_new_session=True, check=False)
    assert r.returncode == 70, r.stderr
    assert "unexpected error (a bug" in r.stderr and "Traceback" in r.stderr
    assert "ValueError: invalid literal for int() with base 10: 'not a number'" in r.stderr
    assert "config error" not in r.stderr


def test_bad_arguments_and_bad_config_are_exit_64(tmp_path: Path) -> None:
    r = run_cli("check", "--seconds", "soon")
    assert r.returncode == 64 and "not a number of seconds: 'soon'" in r.stderr
    r = run_cli("no-such-command")
    assert r.returncode == 64 and "invalid choice" in r.stderr
    r = run_cli("pause", "--for", "a while", "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 64 and "not a duration: 'a while'" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("check", "--url", "ftp://example.invalid")
    assert r.returncode == 64 and "engine.url" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- the version: pyproject.toml, once


def test_version_comes_from_pyproject_through_the_package_metadata(receiver: Callable[..., Receiver]) -> None:
    version = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["version"]
    assert watchdog.__version__ == version
    r = run_cli("--version")
    head = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=30, check=True).stdout.strip()
    # an editable install of this checkout: the commit is the checkout's own (tests/unit/test_release.py: builds)
    assert r.returncode == 0 and r.stdout.startswith(f"engine-watchdog {version} (commit {head}"), r.stdout
    # bundles: the manifest's versions come from context.engine_versions (here no engine answers /version)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = EngineHTTP(f"http://127.0.0.1:{s.getsockname()[1]}")
    assert engine_versions([], nobody, None) == {"watchdog": version}
    nobody.close()
    # alerts: every sink's requests say which watchdog sent them
    hook = receiver()
    WebhookSink(hook.url).send(Alert("stall_detected", "inc-1", "0", "vllm", "http://127.0.0.1:8000", "frozen", "x"))
    [(_path, headers, _body)] = hook.received
    assert headers["User-Agent"] == f"engine-watchdog/{version}"


def test_version_without_package_metadata_is_unknown_not_a_crash(tmp_path: Path) -> None:
    """A source tree that was never installed (no dist-info anywhere on the path) still imports."""
    shutil.copytree(CHECKOUT / "watchdog", tmp_path / "watchdog", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-S", "-c", "import watchdog; print(watchdog.__version__)"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, start_new_session=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == watchdog.UNKNOWN_VERSION == "0+unknown", r.stderr
