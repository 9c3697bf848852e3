"""status.json's cadence: rewritten on a change, every few seconds in trouble, every half minute when calm, its
mtime touched in between; a failed write is tried whole again. Real files in a temporary directory; time is data."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from watchdog.act.state import load_status
from watchdog.core.types import State, Verdict
from watchdog.service.status_file import STATUS_CALM_EVERY, STATUS_EVERY, STATUS_TOUCH_EVERY, StatusFile

WALL = 1_800_000_000.0


def verdict(state: State, since: float = 0.0) -> Verdict:
    return Verdict("0", state, f"{state.value} for a while", since, since)


def status(**over: Any) -> dict[str, Any]:
    return {"incident": None, "paused": False, "budget_left": 3, "recovery": None, **over}


class Writes:
    def __init__(self, tmp: Path) -> None:
        self.errors = 0
        self.file = StatusFile(tmp, {"stack": "s", "url": "http://127.0.0.1:1", "interval": 1.0}, self.count)

    def count(self) -> None:
        self.errors += 1

    def at(self, now: float, *verdicts: Verdict, **over: Any) -> bool:
        return self.file.update(list(verdicts), status(**over), None, now, now, WALL + now)


def test_written_first_then_only_when_something_shown_changes(tmp_path: Path) -> None:
    w = Writes(tmp_path)
    assert w.at(0.0, verdict(State.IDLE))
    written = json.loads((tmp_path / "status.json").read_text())
    assert written["stack"] == "s" and written["engines"][0]["state"] == "idle" and written["pid"] == os.getpid()
    assert not w.at(1.0, verdict(State.IDLE))
    assert w.at(2.0, verdict(State.WORKING, since=2.0))  # a new state
    assert w.at(3.0, verdict(State.WORKING, since=2.0), paused=True)  # the operator paused it


def test_calm_is_rewritten_every_half_minute_and_trouble_every_few_seconds(tmp_path: Path) -> None:
    w = Writes(tmp_path)
    assert w.at(0.0, verdict(State.IDLE))
    assert not w.at(STATUS_CALM_EVERY - 0.5, verdict(State.IDLE))
    assert w.at(STATUS_CALM_EVERY, verdict(State.IDLE))
    t = STATUS_CALM_EVERY + 1
    assert w.at(t, verdict(State.SUSPECT, since=t))
    assert not w.at(t + STATUS_EVERY - 0.5, verdict(State.SUSPECT, since=t))
    assert w.at(t + STATUS_EVERY, verdict(State.SUSPECT, since=t))  # its reason counts seconds


def test_an_unchanged_status_is_touched_so_a_reader_knows_the_service_stands_by_it(tmp_path: Path) -> None:
    w = Writes(tmp_path)
    assert w.at(0.0, verdict(State.IDLE))
    old = time.time() - 100  # the touch sets the real time
    os.utime(tmp_path / "status.json", (old, old))
    assert not w.at(STATUS_TOUCH_EVERY - 1, verdict(State.IDLE))
    assert (tmp_path / "status.json").stat().st_mtime == old  # not yet
    assert not w.at(STATUS_TOUCH_EVERY, verdict(State.IDLE))
    assert (tmp_path / "status.json").stat().st_mtime > old
    loaded = load_status(tmp_path, WALL + STATUS_TOUCH_EVERY)
    assert loaded is not None and loaded["engines"][0]["state"] == "idle"


def test_a_failed_write_is_counted_and_tried_whole_on_the_next_pass(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    w = Writes(gone)  # the state directory does not exist: the write fails
    assert not w.at(0.0, verdict(State.IDLE))
    assert w.errors == 1
    gone.mkdir()
    assert w.at(1.0, verdict(State.IDLE))  # unchanged, yet written: the last try failed
    assert json.loads((gone / "status.json").read_text())["engines"][0]["state"] == "idle"


def test_a_failed_touch_makes_the_next_pass_rewrite(tmp_path: Path) -> None:
    w = Writes(tmp_path)
    assert w.at(0.0, verdict(State.IDLE))
    (tmp_path / "status.json").unlink()
    assert not w.at(STATUS_TOUCH_EVERY, verdict(State.IDLE))  # the touch fails: nothing to touch
    assert w.at(STATUS_TOUCH_EVERY + 1, verdict(State.IDLE))
    assert (tmp_path / "status.json").exists()


def test_the_act_stages_status_is_written_not_changed(tmp_path: Path) -> None:
    """The status dict belongs to the act stage (the exporter's gauges read it too): the file gets a copy with the
    service's fields added, and the dict handed in is left as it was."""
    given = status()
    assert StatusFile(tmp_path, {"stack": "s"}).update([verdict(State.IDLE)], given, None, 0.0, 0.0, WALL)
    assert given == status()
    assert json.loads((tmp_path / "status.json").read_text())["engines"][0]["state"] == "idle"
