"""The CLI's errors are short: one line each, the thing named, no traceback, no repr of a whole value, no URL with
the scrape's filter. Real `watchdog` processes, real files and a closed port."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

LONGEST = 240  # characters in one error line: a terminal's line or two, never a page


def watchdog_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", *args], capture_output=True, text=True, timeout=60,
                          start_new_session=True, check=False)


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_refused_scrape_names_the_page_not_the_filter() -> None:
    url = closed_url()
    r = watchdog_cli("check", "--url", url + "/metrics", "--seconds", "1")
    [line] = r.stdout.splitlines()
    assert r.returncode == 2
    assert line == f"engine server: DOWN: nothing listening at {url}/metrics/ (connection refused)"
    r = watchdog_cli("check", "--url", url, "--seconds", "1", "--json")
    [engine] = json.loads(r.stdout)["engines"]
    assert "?" not in engine["reason"] and "name[]" not in engine["reason"] and len(engine["reason"]) < LONGEST


def test_a_long_wrong_value_is_cut_in_the_config_error(tmp_path: Path) -> None:
    pasted = "x" * 5000
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[judge]\nstall_window = "{pasted}"\n[engine]\nname = "ok"\n')
    r = watchdog_cli("config", "check", "--config", str(bad))
    [line] = r.stderr.splitlines()
    assert r.returncode == 64 and "judge.stall_window: expected a number, got a string 'xxx" in line
    assert line.endswith("... (5002 characters)") and len(line.replace(str(tmp_path), "DIR")) < LONGEST, line
    long_url = "ftp://engine.example/?" + "name[]=vllm:num_requests_running&" * 40
    (tmp_path / "ok.toml").write_text("")
    r = watchdog_cli("check", "--url", long_url, "--config", str(tmp_path / "ok.toml"))
    [line] = r.stderr.splitlines()
    assert r.returncode == 64 and "engine.url: not an http(s) URL: 'ftp://engine.example/?name[]" in line
    assert len(line.replace(str(tmp_path), "DIR")) < LONGEST, line


def _blocker(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("not a directory\n")
    return tmp_path / "a-file"


CASES = [
    (("explain", "{tmp}"), 64, "Is a directory"),
    (("explain", "{blocker}"), 64, "no stack dump recognised"),
    (("replay", "{tmp}/none.jsonl"), 64, "none.jsonl: cannot open: No such file or directory"),
    (("record", "--url", "{closed}", "--seconds", "0.2", "--out", "{blocker}/t.jsonl"), 74, "Not a directory"),
    (("status", "--state-dir", "{blocker}"), 74, "Not a directory"),
    (("pause", "--state-dir", "{blocker}/state"), 74, "Not a directory"),
    (("show", "no-such-incident", "--state-dir", "{tmp}"), 2, "no incident 'no-such-incident'"),
    (("check", "--seconds", "nan"), 64, "--seconds: must be above 0 and finite, got 'nan'"),
    (("check", "--seconds", "soon" * 100), 64, "--seconds: not a number of seconds: 'soonsoon"),
    (("check", "--config", "{tmp}/none.toml"), 64, "none.toml: no such config file"),
    (("nodes", "--config", "{tmp}/none.toml"), 64, "none.toml: no such config file"),
]


@pytest.mark.parametrize(("argv", "code", "said"), CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_every_error_is_one_short_line_without_a_traceback(tmp_path: Path, argv: tuple[str, ...], code: int,
                                                           said: str) -> None:
    args = [a.format(tmp=tmp_path, blocker=_blocker(tmp_path), closed=closed_url()) for a in argv]
    r = watchdog_cli(*args)
    last = r.stderr.splitlines()[-1]
    assert r.returncode == code and said in last, r.stderr
    assert last.startswith("watchdog") and len(last.replace(str(tmp_path), "DIR")) < LONGEST, last
    assert "Traceback" not in r.stderr and "Error(" not in r.stderr and "Errno" not in r.stderr, r.stderr
