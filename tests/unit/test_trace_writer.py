"""The trace file: calm scrapes are held a few seconds and written together; anything else, a flush or the end
writes them at once; nothing held is lost on close; replay reads them back in order."""

from __future__ import annotations

from pathlib import Path

import pytest

from watchdog.core.types import EngineReading, PageReading, ProbeStarted, Scrape
from watchdog.service.trace import TraceWriter, read_trace


def scrape(t: float) -> Scrape:
    return Scrape(t, 1e9 + t, PageReading({"0": EngineReading("0", "m", 1.0, 0.0, 0.1, {"generation_tokens": t})}, 0))


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_calm_scrapes_wait_and_go_out_together(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    w = TraceWriter(path, hold_seconds=3600)
    for t in range(5):
        w.write(scrape(float(t)), hold=True)
    assert lines(path) == 0  # nothing written yet: five lines held
    w.write(ProbeStarted(5.0, 1), 1e9 + 5)  # not held: takes the five with it, in order
    assert lines(path) == 7  # header, five scrapes, the probe
    w.write(scrape(6.0), hold=True)
    w.flush()
    assert lines(path) == 8
    w.write(scrape(7.0), hold=True)
    w.close()  # nothing held is lost at the end
    assert [o.t for o in read_trace(path)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_held_lines_go_out_after_hold_seconds(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    w = TraceWriter(path, hold_seconds=0.0)
    w.write(scrape(0.0), hold=True)
    assert lines(path) == 2
    w.close()


def test_a_failed_write_is_raised_and_the_next_reopens(tmp_path: Path) -> None:
    path = tmp_path / "gone" / "trace.jsonl"
    w = TraceWriter(path)
    with pytest.raises(OSError):
        w.write(scrape(0.0))  # the directory is not there: the caller is told (the daemon counts a write error)
    path.parent.mkdir()
    w.write(scrape(1.0))
    w.close()
    assert [o.t for o in read_trace(path)] == [1.0]
