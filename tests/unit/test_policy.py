"""The restart policy (pure), the persisted state files, and the operator switches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from watchdog.act.incident_types import GaveUp, Incident, Kind, Memory, Phase
from watchdog.act.policy import Budget, Choice, choose
from watchdog.act.state import (
    Control,
    load_control,
    load_memory,
    save_control,
    save_memory,
    save_status,
)
from watchdog.cli.act import parse_duration, status_of
from watchdog.config.load import load
from watchdog.core.types import Decision

B = Budget(budget=3, window=3600.0, backoff_initial=60.0, backoff_max=900.0)
NOW = 1_800_000_000.0


def decide(kind: Kind = Kind.FROZEN, restarts: tuple[float, ...] = (), **kw: object) -> Choice:
    return choose(kind, budget=B, restarts=list(restarts), now=NOW, **kw).choice  # type: ignore[arg-type]


def test_backoff_doubles_up_to_the_maximum() -> None:
    assert [B.backoff(n) for n in range(7)] == [0.0, 60.0, 120.0, 240.0, 480.0, 900.0, 900.0]
    assert Budget(backoff_initial=0.0).backoff(3) == 0.0
    assert B.backoff(64) == B.backoff(5000) == 900.0  # past a float's range too: the maximum, never an error
    assert Budget(backoff_initial=10.0, backoff_max=5.0).backoff(1) == 5.0  # the maximum holds from the first


def test_budget_counts_only_the_window_and_what_came_after_a_reset() -> None:
    restarts = [NOW - 4000, NOW - 3000, NOW - 100]
    assert B.recent(restarts, NOW) == [NOW - 3000, NOW - 100]
    assert B.left(restarts, NOW) == 1
    assert B.left(restarts, NOW, reset_at=NOW - 200) == 2
    assert B.left([NOW - 3, NOW - 2, NOW - 1, NOW], NOW) == 0


def test_first_restart_is_immediate_then_backoff_then_give_up() -> None:
    assert decide() == Choice.RESTART
    d = choose(Kind.FROZEN, budget=B, restarts=[NOW - 10], now=NOW)
    assert d.choice == Choice.WAIT and d.not_before == NOW - 10 + 60 and "50s" in d.reason
    assert decide(restarts=(NOW - 61,)) == Choice.RESTART
    assert decide(restarts=(NOW - 500, NOW - 100)) == Choice.WAIT  # 2 issued: 120 s after the last
    assert decide(restarts=(NOW - 500, NOW - 121)) == Choice.RESTART
    spent = choose(Kind.FROZEN, budget=B, restarts=[NOW - 900, NOW - 500, NOW - 100], now=NOW)
    assert spent.choice == Choice.GIVE_UP and "a human is needed" in spent.reason


@pytest.mark.parametrize(("kw", "kind", "want"), [
    ({"paused": True}, Kind.FROZEN, Choice.PAUSED),
    ({"paused": True, "gave_up": True}, Kind.FROZEN, Choice.PAUSED),  # pause wins: nothing at all happens
    ({"gave_up": True}, Kind.FROZEN, Choice.OBSERVE),
    ({"stacks_working": True}, Kind.FROZEN, Choice.HOLD),
    ({"stacks_working": True}, Kind.DOWN, Choice.RESTART),  # a dead server is not held by old stacks
    ({"supervised": True}, Kind.DOWN, Choice.AWAIT_SUPERVISOR),
    ({"supervised": True}, Kind.FROZEN, Choice.RESTART),  # a supervisor does not see a freeze
    ({"on_boot_timeout": False}, Kind.BOOT_TIMEOUT, Choice.OBSERVE),
    ({}, Kind.BOOT_TIMEOUT, Choice.RESTART),
    ({"has_steps": False}, Kind.FROZEN, Choice.OBSERVE),
    ({"dry_run": True}, Kind.FROZEN, Choice.DRY_RUN),
])
def test_choice_order(kw: dict[str, object], kind: Kind, want: Choice) -> None:
    assert decide(kind, **kw) == want


def test_dry_run_never_spends_the_budget() -> None:
    assert decide(restarts=(NOW - 3, NOW - 2, NOW - 1), dry_run=True) == Choice.DRY_RUN


# -- state files -----------------------------------------------------------------------------------------


def test_memory_round_trips_and_a_corrupt_file_is_kept_aside(tmp_path: Path) -> None:
    inc = Incident("i-1", "0", Kind.FROZEN, NOW, "no progress", phase=Phase.RESTARTING, attempts=1,
                   restart_started=NOW, evidence=Decision.STUCK)
    blind = Incident("i-2", "0", Kind.BLIND, NOW, "unseen", unseen="node:worker1")
    save_memory(tmp_path, Memory((NOW - 5, NOW), GaveUp(NOW, "i-0", "x"), inc, (blind,)))
    got = load_memory(tmp_path)
    assert got == Memory((NOW - 5, NOW), GaveUp(NOW, "i-0", "x"), inc, (blind,))
    assert type(got.incident.kind) is Kind and type(got.incident.phase) is Phase  # type: ignore[union-attr]
    on_disk = json.loads((tmp_path / "recovery.json").read_text())
    assert on_disk["incident"]["phase"] == "restarting" and on_disk["gave_up"] == {"at": NOW, "incident": "i-0",
                                                                                    "reason": "x"}
    assert oct((tmp_path / "recovery.json").stat().st_mode & 0o777) == "0o640"
    (tmp_path / "recovery.json").write_text("{not json")
    assert load_memory(tmp_path) == Memory()
    aside = list(tmp_path.glob("recovery.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == "{not json"
    (tmp_path / "recovery.json").write_text(json.dumps({"version": 99}))
    assert load_memory(tmp_path) == Memory()


def test_control_round_trips_and_pauses_expire(tmp_path: Path) -> None:
    assert load_control(tmp_path) == Control()
    save_control(tmp_path, Control(paused=True, paused_until=NOW + 60, reason="upgrade", paused_at=NOW))
    c = load_control(tmp_path)
    assert c.is_paused(NOW) and c.is_paused(NOW + 59) and not c.is_paused(NOW + 60)
    assert Control(paused=True).is_paused(NOW + 1e9)  # until resumed
    assert not list(tmp_path.glob(".*tmp"))  # no temp file left behind


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200),
                                               ("1h30m", 5400), ("1d", 86400), ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5x", "-5m", "0", "1h 30m", "m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_status_knows_a_stale_daemon_from_a_running_one(tmp_path: Path) -> None:
    cfg = load(None).with_overrides(state={"dir": str(tmp_path)})
    code, s = status_of(cfg, NOW)
    assert code == 3 and s["daemon"] == "not running" and s["status_age_seconds"] is None
    save_status(tmp_path, {"time": NOW - 2, "interval": 1.0, "budget_left": 3})
    os.utime(tmp_path / "status.json", (NOW - 2, NOW - 2))
    code, s = status_of(cfg, NOW)
    assert code == 0 and s["daemon"] == "running" and s["budget_left"] == 3
    code, s = status_of(cfg, NOW + 600)
    assert code == 3 and s["daemon"] == "not running"
    save_control(tmp_path, Control(paused=True))
    assert status_of(cfg, NOW)[1]["paused"] is True
