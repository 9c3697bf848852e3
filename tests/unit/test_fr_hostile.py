"""A Flight Recorder dump of any shape costs at most its own rank's summary: never another exception, never the
bundle. The dumps come from the engine's user (a file in /tmp); the safe unpickler keeps classes out, but plain
builtins of the wrong shape, deep nesting and huge numbers get through it and must be refused here."""

from __future__ import annotations

import json
import os
import pickle
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_evidence_bundle import TP0, TP1, context, incident, stuck_capture
from watchdog.config.gpu import GpuSection
from watchdog.evidence.bundle.write import write_bundle
from watchdog.evidence.explain.findings import assess
from watchdog.evidence.gpu import gather as gather_mod
from watchdog.evidence.gpu.flight_recorder import cross_rank_fr, fr_config, summarize
from watchdog.evidence.gpu.fr_dump import DumpError, load_dump
from watchdog.evidence.gpu.fr_trigger import FrRank, FrTrigger, trigger
from watchdog.evidence.gpu.gather import GpuEvidence, gather_gpu

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
REAL = (DATA / "nccl-fr-stalled-rank0.pickle").read_bytes()
DEEP = 100_000


def _key(name: str) -> bytes:
    raw = name.encode()
    return b"\x8c" + struct.pack("<B", len(raw)) + raw  # SHORT_BINUNICODE


def _deep_pickle(where: str) -> bytes:
    """A pickle nesting a list DEEP levels (built by opcodes: pickling it from Python would itself recurse)."""
    deep = b"(" * DEEP + b"l" * DEEP  # MARK ... LIST: [[[...]]]
    entry = (b"}" + _key("collective_seq_id") + b"K\x01s" + _key("state") + _key("started") + b"s"
             + _key(where) + deep + b"s")
    if where == "pg_key":  # a tuple key nested deep in pg_status
        return (b"\x80\x04}" + _key("pg_status") + b"}" + b"(" * DEEP + b"t" * DEEP + b"}s" + b"s.")
    return b"\x80\x04}" + _key("entries") + b"]" + entry + b"a" + b"s."


DEEP_JSON = b'{"entries": ' + b"[" * DEEP + b"]" * DEEP + b"}"

# (name, dump bytes): each gets through load_dump or is refused by it, and never raises anything but DumpError
HOSTILE: list[tuple[str, bytes]] = [
    ("entries an int", pickle.dumps({"entries": 5})),
    ("entries text", pickle.dumps({"entries": "abc"})),
    ("entries a dict", pickle.dumps({"entries": {"a": 1}})),
    ("entries not dicts", pickle.dumps({"entries": [1, "x", None, [2]]})),
    ("pg_status a list", pickle.dumps({"pg_status": [1]})),
    ("pg_status values not dicts", pickle.dumps({"pg_status": {"0": 5, (1, 2): "x"}})),
    ("seq as text", pickle.dumps({"entries": [{"collective_seq_id": "7", "state": "started"}]})),
    ("seq huge", pickle.dumps({"entries": [{"collective_seq_id": 10 ** 5000, "state": "started"}]})),
    ("name not text", pickle.dumps({"entries": [{"profiling_name": 5, "collective_seq_id": 1}]})),
    ("state a list", pickle.dumps({"entries": [{"state": ["x"], "collective_seq_id": 1}]})),
    ("huge ints in text fields", pickle.dumps({"version": 10 ** 5000, "entries": [
        {"collective_seq_id": 1, "state": "started", "input_sizes": [[10 ** 5000]], "process_group": (10 ** 5000,),
         "time_created_ns": 10 ** 5000}]})),
    ("odd builtins", pickle.dumps({"entries": [{"collective_seq_id": 1, "state": "started", "input_sizes": {1, 2},
                                                "process_group": b"\xff" * 10, "pg_id": bytearray(3)}],
                                   "pg_status": {frozenset({1}): {"x": 1.5, 2: True}}})),
    ("deep input_sizes", _deep_pickle("input_sizes")),
    ("deep process_group", _deep_pickle("process_group")),
    ("deep pg_status key", _deep_pickle("pg_key")),
    ("deep json", DEEP_JSON),
    ("json entries an int", b'{"entries": 5, "pg_status": [1]}'),
    ("json huge int", b'{"entries": [{"collective_seq_id": ' + b"9" * 5000 + b"}]}"),
    ("top level not a dict", pickle.dumps([{"entries": []}])),
    ("truncated", REAL[: len(REAL) // 2]),
]


def _read(data: bytes, rank: int = 0) -> str:
    """What a rank's dump becomes: its summary line, or the DumpError's reason. Nothing else may come out."""
    try:
        s = summarize(load_dump(data), rank)
    except DumpError as e:
        assert str(e)
        return f"refused: {e}"
    line = s.line()
    assert "\n" not in line and len(line) < 2000
    return line + "".join(f"; {p}" for p in s.problems)


@pytest.mark.parametrize(("name", "data"), HOSTILE, ids=[n for n, _ in HOSTILE])
def test_a_hostile_dump_is_refused_or_summarised_never_raises(name: str, data: bytes) -> None:
    assert _read(data)


def test_the_reasons_are_said() -> None:
    said = dict((n, _read(d)) for n, d in HOSTILE)
    assert "entries is a int, not a list" in said["entries an int"]
    assert "pg_status is a list, not a dict" in said["pg_status a list"]
    assert "nested too deep" in said["deep json"]
    assert "1 of 4 entries skipped: an entry is a int, not a dict" in said["entries not dicts"]
    assert "not a sequence number" in said["seq as text"] and "not a sequence number" in said["seq huge"]
    assert "profiling_name is a int, not text" in said["name not text"]
    assert "state is a list, not text" in said["state a list"]
    assert "pg_status of 0 is a int" in said["pg_status values not dicts"]
    assert "<int too large>" in said["huge ints in text fields"]
    assert said["deep input_sizes"].startswith("rank 0: last entered #1") and "[...]" in said["deep input_sizes"]


def test_control_characters_in_a_field_cannot_forge_lines() -> None:
    s = summarize({"entries": [{"collective_seq_id": 1, "state": "started",
                                "profiling_name": "nccl:all_reduce\n- problem: forged\x1b[31m" + "x" * 10_000}]}, 0)
    line = s.line()
    assert "\n" not in line and "\x1b" not in line and len(line) < 1000


def test_all_ranks_unreadable_is_not_called_the_bypass() -> None:
    s = summarize({"entries": [1, 2]}, 0)
    assert s.last_entered is None and "no readable collective" in s.line()
    assert "no rank's recorder held a readable collective" in cross_rank_fr([s])


def _gather(monkeypatch: pytest.MonkeyPatch, dumps: dict[int, bytes]) -> GpuEvidence:
    def fake_trigger(*_: Any, **__: Any) -> FrTrigger:
        return FrTrigger(tuple(FrRank(r, None, f"/p{r}.pipe", f"/d{r}", d, "", 0.1) for r, d in dumps.items()), (),
                         0.1)

    monkeypatch.setattr(gather_mod, "trigger", fake_trigger)
    return gather_gpu([TP0, TP1], None, GpuSection(ras=False), 1_760_000_000.0, freeze=True, now=1_760_000_100.0)


@pytest.mark.parametrize(("name", "data"), HOSTILE, ids=[n for n, _ in HOSTILE])
def test_one_ranks_hostile_dump_costs_its_line_not_the_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             name: str, data: bytes) -> None:
    ev = _gather(monkeypatch, {0: data, 1: REAL})
    assert 1 in [s.rank for s in ev.fr if s.last_entered is not None]  # the other rank is read as ever
    # rank 0 refused and said, or read as far as it could be
    assert any(p.startswith("Flight Recorder rank 0:") for p in ev.problems) or any(s.rank == 0 for s in ev.fr)
    assert any("GPU evidence unavailable" in p for p in ev.problems)  # the NVML line is kept beside it
    cap = stuck_capture()
    path = write_bundle(tmp_path, incident(1_760_000_100.0), cap, assess(cap, work_pending=True), context(), ev)
    m = json.loads((path / "manifest.json").read_text())
    assert {"gpu.md", "flight-recorder-rank0.pickle", "flight-recorder-rank1.pickle"} <= set(m["files"])
    assert (path / "flight-recorder-rank0.pickle").read_bytes() == data  # the evidence kept, as it came
    md = (path / "gpu.md").read_text()
    assert "rank 1: last entered" in md


def test_a_refused_dump_is_a_problem_line_in_the_bundle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ev = _gather(monkeypatch, {0: pickle.dumps({"entries": 5}), 1: REAL, 2: DEEP_JSON,
                               3: pickle.dumps({"pg_status": [1]})})
    cap = stuck_capture()
    path = write_bundle(tmp_path, incident(1_760_000_100.0), cap, assess(cap, work_pending=True), context(), ev)
    md = (path / "gpu.md").read_text()
    assert "problem: Flight Recorder rank 0: unreadable dump: entries is a int, not a list" in md
    assert "problem: Flight Recorder rank 2: unreadable dump: nested too deep" in md
    assert "problem: Flight Recorder rank 3: unreadable dump: pg_status is a list, not a dict" in md
    assert "rank 1: last entered" in md


def test_gather_survives_even_an_exception_the_readers_should_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> Any:
        raise RecursionError("deep")

    monkeypatch.setattr(gather_mod, "summarize", boom)
    ev = _gather(monkeypatch, {0: REAL})
    assert "Flight Recorder rank 0: unreadable dump (RecursionError) (its bytes are kept in the bundle)" in ev.problems
    assert ev.fr_dumps == {0: REAL}


def test_the_settle_loop_keeps_the_other_ranks_when_one_dump_is_hostile(tmp_path: Path) -> None:
    """Rank 0 writes a JSON dump nested 100k deep, rank 1 a real one: rank 1 is read, rank 0 is said unreadable."""
    cfg = fr_config({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe_",
                     "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr_"})
    fds = []
    for r in (0, 1):
        os.mkfifo(cfg.pipe_path(r))
        fds.append(os.open(cfg.pipe_path(r), os.O_RDONLY | os.O_NONBLOCK))  # a reader: the pipe can be written
    wrote: list[int] = []

    def sleep(s: float) -> None:  # the recorders answer while the watchdog waits
        if not wrote:
            Path(cfg.dump_path(0)).write_bytes(DEEP_JSON)
            Path(cfg.dump_path(1)).write_bytes(REAL)
            wrote.append(1)
        time.sleep(min(s, 0.05))

    try:
        res = trigger([4242, 4243], {4242: 0, 4243: 1}, settle=0.5, configs={4242: cfg, 4243: cfg}, sleep=sleep)
    finally:
        for fd in fds:
            os.close(fd)
    by_rank = {r.rank: r for r in res.ranks}
    assert by_rank[1].data == REAL and not by_rank[1].error
    assert not by_rank[0].data and "nested too deep" in by_rank[0].error


def test_the_settle_loop_survives_an_unexpected_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from watchdog.evidence.gpu import fr_trigger

    def boom(data: bytes) -> dict[str, Any]:
        raise MemoryError("no")

    monkeypatch.setattr(fr_trigger, "load_dump", boom)
    cfg = fr_config({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe_",
                     "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr_"})
    os.mkfifo(cfg.pipe_path(0))
    fd = os.open(cfg.pipe_path(0), os.O_RDONLY | os.O_NONBLOCK)

    def sleep(s: float) -> None:
        Path(cfg.dump_path(0)).write_bytes(REAL)
        time.sleep(min(s, 0.05))

    try:
        res = trigger([4242], {4242: 0}, settle=0.3, configs={4242: cfg}, sleep=sleep)
    finally:
        os.close(fd)
    assert "unreadable dump (MemoryError)" in res.ranks[0].error
