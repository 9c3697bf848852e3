"""`--json` on every verb that reports: one JSON document on stdout, parsed here, per verb. Real `watchdog`
processes against a fake engine, a closed port, a recorded bundle (tests/data/hangs) and a node that is not set up.
The verbs without it: run (the service: its events are JSON lines in events.jsonl), record (writes a trace file),
replay (its output is JSON lines already), pause/resume/reset (their effect is in `status --json`), init and nodes
init (they write files; `init --print` prints the TOML)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import FAST, EngineModel, fake_engine
from tests.unit.test_cli_progress import NO_ENGINE
from watchdog.cli.main import build_parser

BUNDLE = Path(__file__).resolve().parents[1] / "data" / "hangs" / "diverged-0.25.1"
REPORTING = {"status", "check", "dump", "nodes", "incidents", "show", "report", "explain", "config check"}


def as_json(*args: str) -> tuple[int, Any]:
    r = subprocess.run([sys.executable, "-m", "watchdog", *args, "--json"], capture_output=True, text=True,
                       timeout=120, start_new_session=True, check=False)
    try:
        return r.returncode, json.loads(r.stdout)  # the whole of stdout: one document
    except ValueError:
        pytest.fail(f"{args}: stdout is not one JSON document: {r.stdout[:500]!r} (stderr: {r.stderr[-500:]})")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A state directory holding one recorded bundle under its own id."""
    ident = json.loads((BUNDLE / "manifest.json").read_text())["id"]
    shutil.copytree(BUNDLE, tmp_path / "state" / "incidents" / ident)
    return tmp_path / "state"


def test_every_reporting_verb_takes_json() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    has = set()
    for name, parser in sub.choices.items():
        inner = [a for a in parser._actions if a.dest.endswith("_command")]
        verbs = [(f"{name} {n}", p) for a in inner for n, p in a.choices.items()] + [(name, parser)]
        has |= {v for v, p in verbs if any("--json" in a.option_strings for a in p._actions)}
    assert has >= REPORTING, REPORTING - has


def test_status(tmp_path: Path) -> None:
    rc, out = as_json("status", "--state-dir", str(tmp_path))
    assert rc == 3 and out["daemon"] == "not running" and out["status_age_seconds"] is None


def test_check(tmp_path: Path) -> None:
    (tmp_path / "fast.toml").write_text(FAST)
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, _):
        rc, out = as_json("check", "--url", url, "--config", str(tmp_path / "fast.toml"))
    assert rc == 0 and out["exit_code"] == 0 and [e["state"] for e in out["engines"]] == ["idle"]


def test_dump(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "no-engine.toml").write_text(NO_ENGINE)  # never another engine's processes on this host
    rc, out = as_json("dump", "--url", url, "--config", str(tmp_path / "no-engine.toml"), "--out",
                      str(tmp_path / "out"))
    assert rc == 2 and out["complete"] is False and Path(out["bundle"]).parent == tmp_path / "out"


def test_nodes(tmp_path: Path) -> None:
    config = tmp_path / "head.toml"
    config.write_text(f'[[nodes]]\nname = "worker1"\nhost = "127.0.0.1"\nidentity_file = "{tmp_path}/no-key"\n'
                      f'known_hosts_file = "{tmp_path}/known_hosts"\n')
    rc, out = as_json("nodes", "--config", str(config))
    assert rc == 1 and out["fine"] is False and out["config"] == str(config)
    assert [n["node"] for n in out["nodes"]] == ["worker1"] and out["nodes"][0]["problems"]


def test_incidents(state: Path) -> None:
    rc, out = as_json("incidents", "--state-dir", str(state))
    assert rc == 0 and [i["id"] for i in out] == [p.name for p in (state / "incidents").iterdir()]


def test_show(state: Path) -> None:
    [bundle] = (state / "incidents").iterdir()
    rc, out = as_json("show", bundle.name[:20], "--state-dir", str(state))  # a prefix, as without --json
    assert rc == 0 and out["id"] == bundle.name and out["complete"] is True
    assert out["manifest"]["id"] == bundle.name and out["summary"] == (bundle / "summary.md").read_text()
    r = subprocess.run([sys.executable, "-m", "watchdog", "show", bundle.name, "--upstream", "--json", "--state-dir",
                        str(state)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 64 and "not allowed with argument" in r.stderr  # Markdown or JSON, not both


def test_report(state: Path) -> None:
    rc, out = as_json("report", "--state-dir", str(state))
    assert rc == 0 and out["incidents"] == 1 and sum(out["decisions"].values()) == 1


def test_explain() -> None:
    dumps = sorted(str(p) for p in (BUNDLE / "dumps").glob("round1-*.json"))
    rc, out = as_json("explain", *dumps)
    assert rc == 0 and len(out["processes"]) == len(dumps) and out["poll_parking"]["status"]


def test_config_check(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("[judge]\nstall_window = 30\n")
    rc, out = as_json("config", "check", "--config", str(tmp_path / "c.toml"))
    assert rc == 0 and out["valid"] is True and out["nodes"] == ["local"]
