"""/readyz and /livez over HTTP: the exporter's routing (nonsense gets 404/405/400, never a crash), the state
directory's check, and the real daemon against the fake engine (idle → ready; frozen → not ready, then not live)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.fakes import FAST, EngineModel, fake_engine, wait_for
from tests.unit.test_act_daemon import Daemon, freeze
from watchdog.core.types import State, Verdict
from watchdog.service.exporter import Exporter, QuietHandler
from watchdog.service.probes import ProbeSettings
from watchdog.service.state_check import StateDirCheck


def served(settings: ProbeSettings | None = None) -> tuple[Exporter, str]:
    e = Exporter(probes=settings)
    port = e.serve("127.0.0.1", 0)
    return e, f"http://127.0.0.1:{port}"


def raw(base: str, data: bytes) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_ready_and_live_answer_json_with_the_deciding_engine() -> None:
    e, base = served()
    assert requests.get(f"{base}/readyz", timeout=10).status_code == 503  # no verdict yet
    assert requests.get(f"{base}/livez", timeout=10).status_code == 200
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 5.0, 10.0), Verdict("1", State.WORKING, "moving", 8.0, 10.0)],
                   10.0)
    r = requests.get(f"{base}/readyz", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    body = r.json()
    assert body["ready"] is True and body["engine"] == "0" and body["engines"] == {"0": "idle", "1": "working"}
    assert body["for_seconds"] >= 5.0
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 5.0, 11.0), Verdict("1", State.FROZEN, "stuck", 11.0, 11.0)],
                   11.0)
    e.set_response({"incident": {"id": "inc-1", "engine": "1"}, "paused": False, "budget_left": 3})
    r = requests.get(f"{base}/readyz", timeout=10)
    assert r.status_code == 503 and r.json()["engine"] == "1" and r.json()["incident"] == "inc-1"
    assert requests.get(f"{base}/readyz?engine=0", timeout=10).status_code == 200
    assert requests.get(f"{base}/readyz", params={"engine": "1"}, timeout=10).status_code == 503
    assert requests.get(f"{base}/livez", timeout=10).status_code == 200  # frozen, but not for 300 s
    assert "watchdog_engine_state" in requests.get(f"{base}/metrics", timeout=10).text  # the metrics as before
    # restarted: its page says idle again, but no generation has proven it yet; the act stage's status says so
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 5.0, 12.0), Verdict("1", State.IDLE, "idle", 12.0, 12.0)],
                   12.0)
    e.set_response({"incident": {"id": "inc-1", "engine": "1", "phase": "proving"}, "paused": False,
                    "budget_left": 2, "recovery": {"phase": "proving", "seconds": 1.0}})
    r = requests.get(f"{base}/readyz", timeout=10)
    assert r.status_code == 503 and r.json()["recovery"] == "proving" and r.json()["state"] == "idle"
    e.set_response({"incident": None, "paused": False, "budget_left": 2})  # recovered and resolved
    assert requests.get(f"{base}/readyz", timeout=10).status_code == 200


def test_nonsense_gets_4xx_and_the_server_goes_on() -> None:
    e, base = served()
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 0.0, 1.0)], 1.0)
    assert requests.post(f"{base}/readyz", timeout=10).status_code == 405
    r = requests.delete(f"{base}/livez", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "GET, HEAD"
    assert requests.put(f"{base}/metrics", data=b"x", timeout=10).status_code == 405
    for path in ("/nope", "/readyz/x", "/%00", "/livez/../etc/passwd", "/favicon.ico", "/" + "a" * 5000):
        assert requests.get(f"{base}{path}", timeout=10).status_code == 404, path
    assert requests.get(f"{base}/readyz?engine=", timeout=10).status_code == 400
    assert requests.get(f"{base}/readyz?engine=%ff%fe", timeout=10).status_code == 404
    assert requests.get(f"{base}/readyz?engine=7&engine=0", timeout=10).status_code == 200  # the last one counts
    assert requests.get(f"{base}/readyz?" + "&".join(f"k{i}=v" for i in range(50)), timeout=10).status_code == 400
    assert requests.get(f"{base}/readyz?verbose&x=%zz", timeout=10).status_code == 200
    head = requests.head(f"{base}/readyz", timeout=10)
    assert head.status_code == 200 and head.content == b""
    for junk in (b"\x00\xff garbage\r\n\r\n", b"GET\r\n\r\n", b"GET /readyz HTTP/9.9\r\n\r\n",
                 b"GET /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", b"BREW /livez HTTP/1.1\r\n\r\n",
                 b"GET /" + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n"):
        reply = raw(base, junk)  # a status line, or (an HTTP/0.9 request) the error page alone, or nothing
        code = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/") else reply.partition(b"Error code: ")[2][:3]
        assert not reply or code[:1] in (b"2", b"4") or code == b"505", reply[:200]  # 505: HTTP/9.9
    assert requests.get(f"{base}/readyz", timeout=10).json()["ready"] is True


def test_a_bug_in_a_probe_answers_500_and_the_server_goes_on() -> None:
    e, base = served()
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 0.0, 1.0)], 1.0)
    e.state_problem = lambda: str(1 / 0)
    r = requests.get(f"{base}/readyz", timeout=10)
    assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]
    assert requests.get(f"{base}/livez", timeout=10).status_code == 200  # /livez never asks the state directory
    e.state_problem = lambda: ""
    assert requests.get(f"{base}/readyz", timeout=10).status_code == 200


def test_a_stuck_pass_loop_fails_both() -> None:
    e, base = served(ProbeSettings(live_after=300.0, stale_after=0.1))
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 0.0, 1.0)], 1.0)
    time.sleep(0.3)  # no pass hands over verdicts meanwhile: the loop is stuck
    for path in ("/readyz", "/livez"):
        r = requests.get(f"{base}{path}", timeout=10)
        assert r.status_code == 503 and "no pass for" in r.json()["watchdog"], path


def test_the_state_directory_check(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    failures = [0]
    t = [0.0]
    check = StateDirCheck(state, lambda: failures[0], clock=lambda: t[0])
    assert check() == ""
    failures[0] = 2
    assert "2 event(s) in a row could not be written" in check()  # until the next look's test write
    failures[0] = 0
    t[0] += 10
    state.rmdir()
    assert "No such file or directory" in check()
    t[0] += 10
    state.write_text("a file")
    assert "not a directory" in check()
    t[0] += 10
    state.unlink()
    state.mkdir()
    assert check() == ""


def test_a_failed_event_write_counts_until_a_test_write_succeeds(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk full for a moment fails one event write; a calm engine writes no other event: the check's own test
    write (at its next look) ends the streak, so /readyz does not stay 503 for ever. A test write that fails keeps
    it; a later failed event write counts again."""
    failures, t = [0], [0.0]
    check = StateDirCheck(tmp_path, lambda: failures[0], clock=lambda: t[0])
    assert check() == ""
    failures[0] = 1  # the event log lost one write; nothing written since
    assert "1 event(s) in a row could not be written" in check()
    t[0] = 2.0
    assert "1 event(s)" in check()  # looked at most every LOOK_EVERY seconds
    t[0] = 5.0
    assert check() == ""  # the test write worked: the disk has room again
    assert list(tmp_path.iterdir()) == []  # and left nothing behind
    t[0] = 60.0
    assert check() == ""
    failures[0] = 2  # another write lost
    real_open = os.open

    def full(path: object, *args: object, **kw: object) -> int:
        if ".state-check-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", full)
    assert "2 event(s)" in check()
    t[0] = 70.0
    assert "test write" in check() and "No space left" in check()  # still full
    monkeypatch.setattr(os, "open", real_open)
    t[0] = 80.0
    assert check() == ""
    failures[0] = 0  # an event written: the streak is over
    assert check() == ""
    failures[0] = 1  # and a new one counts again
    assert "1 event(s)" in check()


def test_livez_does_not_fail_on_the_state_directory() -> None:
    """A full state volume takes the engines out of rotation (/readyz), but recreating the pod would not give it room:
    /livez (wired to the vLLM container) stays 200."""
    e, base = served()
    e.set_verdicts([Verdict("0", State.IDLE, "idle", 0.0, 1.0)], 1.0)
    e.state_problem = lambda: "no space left (0 bytes free)"
    r = requests.get(f"{base}/readyz", timeout=10)
    assert r.status_code == 503 and "cannot be used: no space left" in r.json()["watchdog"]
    live = requests.get(f"{base}/livez", timeout=10)
    assert live.status_code == 200 and live.json()["watchdog"] == "ok"


def test_an_idle_connection_is_dropped(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """A client that connects and sends nothing is closed after the handler's timeout, quietly; the server answers
    the next one."""
    assert QuietHandler.timeout is not None and 0 < QuietHandler.timeout <= 30
    monkeypatch.setattr(QuietHandler, "timeout", 0.3)
    _, base = served()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        began = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - began < 5
    assert requests.get(f"{base}/livez", timeout=10).status_code == 200  # no verdict yet, still answering
    time.sleep(0.1)
    assert "Traceback" not in capfd.readouterr().err


def test_the_daemon_takes_a_frozen_engine_out_then_calls_it_not_live(
        tmp_path: Path, daemon_proc: list[subprocess.Popen[str]]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "w.toml"
    cfg.write_text(FAST.replace("port = 0", f"port = {port}\nlive_after = 2.0"))
    base = f"http://127.0.0.1:{port}"

    def code(path: str) -> int:
        try:
            return requests.get(f"{base}{path}", timeout=5).status_code
        except requests.RequestException:
            return 0

    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        d = Daemon(cfg, tmp_path / "state", daemon_proc)
        d.start("--url", url)
        wait_for(lambda: code("/readyz") == 200, 30, "ready once idle")
        assert code("/livez") == 200
        (tmp_path / "state").rename(tmp_path / "moved")  # the state directory gone: the watchdog cannot vouch
        wait_for(lambda: code("/readyz") == 503, 30, "not ready")
        assert code("/livez") == 200  # a state directory problem never fails /livez
        assert "cannot be used" in requests.get(f"{base}/readyz", timeout=5).json()["watchdog"]
        (tmp_path / "moved").rename(tmp_path / "state")
        wait_for(lambda: code("/readyz") == 200, 30, "ready again")
        freeze(model)
        wait_for(lambda: code("/readyz") == 503, 30, "out once frozen")
        body = requests.get(f"{base}/readyz", timeout=5).json()
        assert body["state"] == "frozen" and body["watchdog"] == "ok"
        wait_for(lambda: code("/livez") == 503, 30, "not live after live_after")
        live = requests.get(f"{base}/livez", timeout=5).json()
        assert live["state"] == "frozen" and live["for_seconds"] >= live["live_after"] == 2.0
        d.stop()
    events = [json.loads(x) for x in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    assert "frozen" in [e.get("to") for e in events]
