"""The service reads the engine's timeouts at start and when an engine comes (back) into service, not on a timer:
a read walks /proc for the engine's processes (13-17 ms of CPU with vLLM TP=2). The daemon runs in this process
against the small fake engine; the read itself is counted in place of the /proc walk."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import FAST, fake_engine, wait_for
from watchdog.config.load import load
from watchdog.core.types import State
from watchdog.service import daemon as daemon_module
from watchdog.service.compose import Hooks, compose
from watchdog.service.daemon import Daemon


class Report:
    def as_dict(self) -> dict[str, Any]:
        return {"warning": None}


def test_timeouts_are_read_at_start_and_when_the_engine_comes_back(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[float] = []

    def read(cfg: object, url: str) -> Report:
        reads.append(time.monotonic())
        return Report()

    monkeypatch.setattr(daemon_module, "read_deadlines", read)
    with fake_engine() as (url, model):
        cfg_path = tmp_path / "w.toml"
        cfg_path.write_text(f'{FAST}[engine]\nurl = "{url}"\n[state]\ndir = "{tmp_path}"\n[gpu]\nenabled = false\n')
        cfg = load(cfg_path)
        d = Daemon(cfg, tmp_path)
        d.parts = compose(cfg, tmp_path, d.http, Hooks(d._count, d._write_trace, d._act_event, d._bundle), d.clock,
                          once=False)
        assert d.parts.watcher is not None
        watcher = d.parts.watcher
        try:
            def states() -> list[State]:
                d.one_pass(watcher)
                time.sleep(0.05)
                return [v.state for v in watcher.judge.verdicts()]

            wait_for(lambda: states() == [State.IDLE], 20, "the fake engine proven idle")
            assert len(reads) == 2  # the first pass, then the engine proven in service
            for _ in range(20):
                assert states() == [State.IDLE]
            assert len(reads) == 2, "read again while nothing changed"
            model.gen, model.prompt = 0, 0  # counters from zero: a new incarnation, to be proven again
            wait_for(lambda: states() == [State.STARTING], 20, "the new incarnation starting")
            wait_for(lambda: states() == [State.IDLE], 20, "the new incarnation proven")
            assert len(reads) == 3
        finally:
            d.parts.close()
            d.http.close()
