"""A daemon that survives its own faults: one stage's exception, and a full disk (a real, small tmpfs).

Either way the pass goes on judging and acting, the fault is counted in a metric, logged, and alerted once; when the
disk has room again the event log resumes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fakes import EngineModel, fake_engine, wait_for
from tests.receiver import Receiver
from tests.unit.test_act_daemon import Daemon, config, freeze
from watchdog.config.load import Config
from watchdog.core.types import EngineReading, PageReading, Scrape, State
from watchdog.judge.judge import Judge
from watchdog.service.compose import Clock
from watchdog.service.daemon import Daemon as WatchdogDaemon
from watchdog.service.watcher import Watcher

# -- one stage raising: the others still run ----------------------------------------------------------------


class FlakyFetcher:
    """Raises (a bug) on the passes named in ``fail``, else serves an idle engine page."""

    def __init__(self, fail: set[int]) -> None:
        self.fail, self.n = fail, 0

    def scrape(self) -> Scrape:
        self.n += 1
        if self.n in self.fail:
            raise ValueError("a bug in the scrape stage")
        page = PageReading({"0": EngineReading("0", "m", 0.0, 0.0, 0.0, {"generation_tokens": float(self.n)})}, 5)
        return Scrape(float(self.n), 1.7e9 + self.n, page)


class RecordingResponder:
    """The act stage's responder stood in for: counts its steps."""

    def __init__(self) -> None:
        self.steps = 0
        self.memory = SimpleNamespace(incident=None)

    def sight(self, local: Any, views: Any, mono: float) -> None:
        pass

    def step(self, verdicts: list[Any], mono: float) -> None:
        self.steps += 1

    def status(self, now: float) -> dict[str, Any]:
        return {"incident": None, "paused": False, "budget_left": 3, "recovery": None, "gave_up": None}

    def blind_status(self) -> list[dict[str, Any]]:
        return []


class RecordingAlerts:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def submit(self, alert: Any) -> None:
        self.sent.append(alert)


class RecordingHeartbeat:
    def __init__(self) -> None:
        self.seen: list[bool] = []

    def beat(self, now: float, observed: bool) -> bool:
        self.seen.append(observed)
        return observed


def act_stage(d: WatchdogDaemon) -> tuple[RecordingResponder, RecordingAlerts, RecordingHeartbeat]:
    parts = (RecordingResponder(), RecordingAlerts(), RecordingHeartbeat())
    d.parts.responder, d.parts.alerts, d.parts.heartbeat = parts  # type: ignore[assignment]
    return parts


def test_an_exception_in_one_stage_is_counted_alerted_once_and_the_loop_goes_on(tmp_path: Path) -> None:
    d = WatchdogDaemon(Config(), tmp_path)
    responder, alerts, _ = act_stage(d)
    clock = iter(range(1, 100))
    watcher = Watcher(FlakyFetcher(fail={2, 3}), Judge(), clock=lambda: float(next(clock)))
    for _ in range(5):
        d.one_pass(watcher)
    assert responder.steps == 5  # the act stage ran in every pass, also those whose scrape raised
    assert d.exporter.pass_errors.labels("scrape")._value.get() == 2
    assert [(a.event, a.details["stage"], a.details["error"]) for a in alerts.sent] == [
        ("watchdog_fault", "scrape", "ValueError: a bug in the scrape stage")]  # alerted once
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["stage"] for e in events if e["event"] == "watchdog_fault"] == ["scrape", "scrape"]
    assert watcher.judge.verdicts()[0].state in (State.STARTING, State.IDLE)  # judged again after the faults
    d.events.close()


class ScriptedFetcher:
    """An idle engine serving (a token a pass), or the failure kind named for a pass."""

    def __init__(self) -> None:
        self.n, self.fail_kind = 0, ""

    def scrape(self) -> Scrape:
        self.n += 1
        if self.fail_kind:
            return Scrape(float(self.n), 1.7e9 + self.n, None, self.fail_kind, "the page not complete after 10s")
        page = PageReading({"0": EngineReading("0", "m", 0.0, 0.0, 0.0, {"generation_tokens": float(self.n)})}, 5)
        return Scrape(float(self.n), 1.7e9 + self.n, page)


def test_every_pass_runs_the_act_stage_and_the_heartbeat_beats_only_for_a_pass_that_read_the_page(
        tmp_path: Path) -> None:
    """The act stage runs on every pass, calm or not (the incident machine, the control file, status.json); the
    dead-man heartbeat is told a pass saw the engine only when its page was read and no verdict is blind."""
    now = [100.0]
    d = WatchdogDaemon(Config(), tmp_path, clock=Clock(lambda: now[0], time.time))
    responder, _, heartbeat = act_stage(d)
    fetcher = ScriptedFetcher()
    watcher = Watcher(fetcher, Judge(), clock=lambda: now[0])

    def passes(n: int) -> int:
        before = responder.steps
        for _ in range(n):
            now[0] += 1.0
            d.one_pass(watcher)
        return responder.steps - before

    assert passes(3) == 3  # starting, then idle (a transition), then a calm pass
    assert passes(6) == 6  # calm: still every pass
    assert heartbeat.seen[-1] is True
    fetcher.fail_kind = "trickle"  # the page not read: blind
    assert passes(2) == 2
    assert heartbeat.seen[-3:] == [True, False, False]  # the heartbeat's word: these passes did not read the page
    d.events.close()


# -- a full disk ------------------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "state"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0750", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


def fill(path: Path) -> None:
    """No room left, not even in the last page of the daemon's open logs (padded with blank lines to a page)."""
    for name in ("events.jsonl", "trace.jsonl"):
        size = (path / name).stat().st_size
        with open(path / name, "ab", buffering=0) as f:
            f.write(b" " * (-(size + 1) % 4096) + b"\n")
    with open(path / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    with pytest.raises(OSError) as e, open(path / "probe", "wb", buffering=0) as f:
        f.write(b"\0" * 4096)
    assert e.value.errno == errno.ENOSPC


def test_a_full_disk_loses_events_not_the_watch(small_tmpfs: Path, receiver: Callable[..., Receiver],
                                                daemon_proc: list[subprocess.Popen[str]]) -> None:
    hook = receiver()
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        d = Daemon(config(small_tmpfs.parent, url, [hook.url + "/hook"]), small_tmpfs, daemon_proc)
        d.start("--url", url)
        wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
        fill(small_tmpfs)
        freeze(model)  # the watch must still see the freeze, alert and restart with no room to write
        wait_for(lambda: {"stall_detected", "restart_started"} <= {b["event"] for b in hook.bodies()}, 30,
                 "the freeze alerted and acted on")
        wait_for(lambda: "watchdog_fault" in [b["event"] for b in hook.bodies()], 15, "the fault alerted")
        (small_tmpfs / "filler").unlink()
        (small_tmpfs / "probe").unlink(missing_ok=True)
        wait_for(lambda: any(e["event"] == "recovered" for e in d.events()), 30, "events written again")
        err = d.stop()
    faults = [b for b in hook.bodies() if b["event"] == "watchdog_fault"]
    assert len({f["details"]["stage"] for f in faults}) == len(faults)  # once per stage
    assert any("events.jsonl" in f["details"]["error"] or "trace.jsonl" in f["details"]["error"] for f in faults)
    assert "cannot write" in err and "No space left on device" in err
    assert "lost events" in err  # and written again once there was room
