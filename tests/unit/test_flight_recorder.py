"""The Flight Recorder: settings from a real environ, real dumps from H200s read safely, the pipe trigger."""

from __future__ import annotations

import os
import pickle
import select
import threading
from pathlib import Path

import pytest

from tests.facts import says
from watchdog.evidence.gpu.flight_recorder import BYPASS_NOTE, cross_rank_fr, fr_config, parse_environ, summarize
from watchdog.evidence.gpu.fr_dump import DumpError, load_dump
from watchdog.evidence.gpu.fr_trigger import config_of, trigger

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"


def _dump(name: str) -> dict[str, object]:
    return load_dump((DATA / name).read_bytes())


def test_environ_and_settings() -> None:
    env = parse_environ(b"PATH=/bin\0TORCH_FR_BUFFER_SIZE=2000\0TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/run/fr/pipe_\0"
                        b"TORCH_FR_DUMP_TEMP_FILE=/run/fr/fr_\0junk\0")
    cfg = fr_config(env)
    assert cfg.can_dump and cfg.pipe_path(3) == "/run/fr/pipe_3.pipe" and cfg.dump_path(3) == "/run/fr/fr_3"
    old = fr_config({"TORCH_NCCL_TRACE_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/p_",
                     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/d_"})
    assert old.can_dump and old.dump_prefix == "/d_"
    off = fr_config({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/p_"})
    assert not off.can_dump and "off" in off.problems[0] and off.dump_prefix == "/tmp/nccl_trace_rank_"
    assert "no dump pipe" in fr_config({"TORCH_FR_BUFFER_SIZE": "5"}).problems[0]
    assert not fr_config({"TORCH_FR_BUFFER_SIZE": "lots"}).can_dump


def test_config_of_this_process_and_a_missing_one() -> None:
    assert config_of(os.getpid()) is not None
    assert config_of(2**22 + 12345) is None


def test_real_stalled_one_rank() -> None:
    s = summarize(_dump("nccl-fr-stalled-rank0.pickle"), 0)
    assert s.entries == 7 and s.last_entered is not None and s.first_unfinished is not None
    assert (s.last_entered.seq, s.last_entered.name, s.last_entered.state) == (7, "nccl:all_reduce_barrier",
                                                                              "scheduled")
    assert (s.first_unfinished.seq, s.first_unfinished.name) == (6, "nccl:all_reduce")
    assert s.pg_status["0"]["last_completed_collective"] == 5
    assert says(s.line(), "waits", "#6", "nccl:all_reduce")
    healthy = summarize(_dump("nccl-fr-healthy-rank0.pickle"), 0)
    assert healthy.first_unfinished is None and healthy.last_entered is not None
    assert healthy.last_entered.state == "completed"


def test_real_bypass_sees_nothing() -> None:
    s = summarize(_dump("nccl_bypass-fr-stalled-rank0.pickle"), 0)
    assert s.entries == 0 and s.note == BYPASS_NOTE and "PyNccl" in s.line()
    assert cross_rank_fr([s]) == BYPASS_NOTE


def test_real_two_ranks_name_the_one_that_stopped() -> None:
    r0, r1 = (summarize(_dump(f"nccl2-fr-stalled-rank{r}.pickle"), r) for r in (0, 1))
    assert r0.last_entered is not None and r1.last_entered is not None
    assert r0.last_entered.seq == 6 and r1.last_entered.seq == 5
    said = cross_rank_fr([r0, r1])
    assert says(said, "1", "never entered", "#6") and not says(said, "0"), said  # rank 1 stopped, rank 0 is not blamed


def test_every_rank_waiting_together() -> None:
    s = summarize(_dump("nccl-fr-stalled-rank0.pickle"), 0)
    assert "wait together" in cross_rank_fr([s, summarize(_dump("nccl-fr-stalled-rank0.pickle"), 1)])
    assert cross_rank_fr([]) == ""


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_unpickler_refuses_classes_and_bad_input() -> None:
    with pytest.raises(DumpError, match="refused"):
        load_dump(pickle.dumps({"entries": [Evil()]}))
    with pytest.raises(DumpError):
        load_dump(b"")
    with pytest.raises(DumpError):
        load_dump(b"\x80\x04garbage")
    with pytest.raises(DumpError, match="cap"):
        load_dump(b"x" * 100, max_bytes=10)
    with pytest.raises(DumpError, match="dict"):
        load_dump(pickle.dumps([1, 2]))
    assert load_dump(b'{"entries": []}') == {"entries": []}


def test_trigger_through_a_real_fifo(tmp_path: Path) -> None:
    cfg = fr_config({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe_",
                     "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr_"})
    os.mkfifo(cfg.pipe_path(0))
    real = (DATA / "nccl-fr-stalled-rank0.pickle").read_bytes()

    ready = threading.Event()

    def recorder() -> None:  # what torch's monitor thread does: hold the pipe open, read a line, write the dump
        fd = os.open(cfg.pipe_path(0), os.O_RDONLY | os.O_NONBLOCK)
        ready.set()
        try:
            readable, _, _ = select.select([fd], [], [], 30)
            assert readable and os.read(fd, 1)
        finally:
            os.close(fd)
        Path(cfg.dump_path(0)).write_bytes(real)

    t = threading.Thread(target=recorder, daemon=True)  # never holds pytest open, whatever happens
    t.start()
    assert ready.wait(30)  # the reader is there before the watchdog asks (a stopped-rank race is another test)
    try:
        res = trigger([4242], {4242: 0}, settle=30.0, configs={4242: cfg})
    finally:
        t.join(30)
    [rank] = res.ranks
    assert rank.data == real and not rank.error


def test_trigger_without_reader_or_settings(tmp_path: Path) -> None:
    cfg = fr_config({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/pipe_",
                     "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr_"})
    os.mkfifo(cfg.pipe_path(1))
    res = trigger([7], {7: 1}, settle=0.5, configs={7: cfg})
    assert "nobody reads the pipe" in res.ranks[0].error and not res.ranks[0].data
    res = trigger([7, 8], None, settle=0.3, configs={7: cfg, 8: fr_config({})})  # rank found from the pipe's name
    assert [r.rank for r in res.ranks] == [1] and any("pid 8" in p for p in res.problems)
    none = fr_config({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{tmp_path}/absent_",
                      "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr_"})
    silent = trigger([10], None, settle=0.3, configs={10: none})  # on, yet no pipe was made: said, not silence
    assert not silent.ranks and any("pid 10" in p and "no pipe" in p and "absent_<rank>.pipe" in p
                                    for p in silent.problems)
    stale = trigger([9], {9: 2}, settle=0.3, configs={9: cfg})
    assert "No such file" in stale.ranks[0].error
