"""Run the real `watchdog run` command against a server and read what it reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from watchdog.service.events import generations


def quick_config(suspect: float, window: float, probe: float, extra: str = "", state: str = "") -> str:
    """A config for tests: twice-a-second scrapes and the test's own thresholds; ``state``: more of ``[state]``."""
    return (f"[scrape]\ninterval = 0.5\n[judge]\nsuspect_after = {suspect}\nstall_window = {window}\n"
            f"[probe]\ninterval = {probe}\nretry = 2.0\ntimeout = 120.0\n[state]\ntrace_max_bytes = 0\n{state}"
            f"{extra}")


class WatchdogProcess:
    """`python -m watchdog run` in its own session, with a config of the test's choosing."""

    def __init__(self, url: str, state_dir: Path, config_text: str = "", metrics_port: int = 0,
                 env: dict[str, str] | None = None) -> None:
        self.url, self.env = url, env
        self.state_dir = state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.config = state_dir / "watchdog.toml"
        self.config.write_text(config_text)
        self.log_path = state_dir / "watchdog.log"
        self.metrics_port = metrics_port
        self._popen: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def events_path(self) -> Path:
        return self.state_dir / "events.jsonl"

    def start(self) -> WatchdogProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "watchdog",
                    "run",
                    "--url",
                    self.url,
                    "--state-dir",
                    str(self.state_dir),
                    "--config",
                    str(self.config),
                    "--metrics-port",
                    str(self.metrics_port),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        finally:
            log.close()
        self.started_at = time.time()
        return self

    def events(self) -> list[dict[str, Any]]:
        """Both generations of the event log, oldest first."""
        out: list[dict[str, Any]] = []
        for p in generations(self.events_path):
            if p.exists():
                out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return out

    def transitions(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == "transition"]

    def states(self) -> list[str]:
        return [e["to"] for e in self.transitions()]

    def current(self, engine: str = "0") -> str | None:
        mine = [e["to"] for e in self.transitions() if e["engine"] == engine]
        return mine[-1] if mine else None

    def wait_for_state(self, state: str, timeout: float, engine: str = "0", after: float = 0.0) -> dict[str, Any]:
        """The first event entering `state` whose wall time is after `after` (unix seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.transitions():
                if e["engine"] == engine and e["to"] == state and event_time(e) >= after:
                    return e
            if self._popen is not None and self._popen.poll() is not None:
                raise AssertionError(f"watchdog exited with {self._popen.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise AssertionError(
            f"no {state!r} for engine {engine} within {timeout}s; events: {self.states()}\n{self.log_tail()}"
        )

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """The first event named `name` (incident_opened, restart_started, recovered, ...), waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if e["event"] == name]
            if found:
                return found[0]
            time.sleep(0.3)
        raise AssertionError(f"no {name} event in {timeout}s: {[e['event'] for e in self.events()]}\n"
                             f"{self.log_tail(60)}")

    @property
    def pid(self) -> int:
        assert self._popen is not None, "not started"
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash, the OOM killer), reaped; the state directory stays as the killed process left it."""
        p = self._popen
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> int | None:
        p = self._popen
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        return p.returncode


def event_time(event: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()
