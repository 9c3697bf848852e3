"""The event log rolls over to ``events.jsonl.1`` past its bound, as the trace does, and loses no record doing so;
readers take both generations in order."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from watchdog.service.events import EventLog, generations


def records(path: Path) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for p in generations(path):
        if p.exists():
            out += [json.loads(line) for line in p.read_text().splitlines()]
    return out


def line_bytes(n: int) -> int:
    return len(json.dumps({"event": "x", "n": n}) + "\n")


def test_past_its_bound_the_log_rolls_over_and_keeps_every_record_in_order(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    bound = 10 * line_bytes(0)
    log = EventLog(path, bound)
    for n in range(35):
        assert log.write({"event": "x", "n": n}) is None
    log.close()
    old, new = generations(path)
    assert old.exists() and path.exists()
    kept = [r["n"] for r in records(path)]
    assert kept == list(range(kept[0], 35)), kept  # the newest, contiguous: only whole old generations go
    assert old.stat().st_size <= bound + line_bytes(99) and new.stat().st_size <= bound + line_bytes(99)
    assert len(kept) > 10  # both generations are read


def test_an_unbounded_log_never_rolls_over(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, 0)
    for n in range(50):
        log.write({"event": "x", "n": n})
    log.close()
    assert not generations(path)[0].exists()
    assert [r["n"] for r in records(path)] == list(range(50))


def test_a_log_already_past_its_bound_at_start_rolls_over_at_its_first_write(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"event": "old"}) + "\n" + "{}\n" * 100)  # written by the watchdog's last life
    log = EventLog(path, 64)
    log.write({"event": "new"})
    log.write({"event": "newer"})
    log.close()
    assert records(path)[0].get("event") == "old"
    assert path.read_text().splitlines() == [json.dumps({"event": "newer"})]


def test_a_rollover_that_fails_loses_nothing_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "events.jsonl"
    generations(path)[0].mkdir()  # a directory where the old generation goes: the rename fails
    log = EventLog(path, 32)
    with caplog.at_level(logging.WARNING, logger="watchdog.host.jsonl_log"):
        for n in range(5):
            assert log.write({"event": "x", "n": n}) is None
    log.close()
    assert [r["n"] for r in (json.loads(x) for x in path.read_text().splitlines())] == list(range(5))
    assert log.lost == 0
    assert any("cannot roll" in r.getMessage() for r in caplog.records)
