"""The fact checker the tests use on generated sentences (tests/facts.py): whole tokens, so a wrong rank or number
fails; any wording around them passes."""

from __future__ import annotations

from tests.facts import clause_of, line_of, says, unsaid

REASON = ("livelock: EngineCore turns its own loop (engine_loop) on 2.7 CPU s in 3 s; rank 1 (Worker_TP1) waits "
          "on its own device. Named by nccl_ras.")


def test_facts_are_whole_tokens_in_any_case() -> None:
    assert says(REASON, "livelock", "ENGINECORE", "engine_loop", "2.7", "3 s", "Worker_TP1", "nccl_ras")
    assert unsaid(REASON, "Worker_TP10", "Worker_TP", "TP1", "2", "7", "12.7", "2.75", "30", "rank 10") == [
        "Worker_TP10", "Worker_TP", "TP1", "2", "7", "12.7", "2.75", "30", "rank 10"]


def test_a_clause_or_a_line_ties_facts_to_one_subject() -> None:
    assert says(clause_of(REASON, "Worker_TP1"), "rank 1", "own device")
    assert not says(clause_of(REASON, "Worker_TP1"), "engine_loop")
    assert clause_of(REASON, "Worker_TP0") == "" and not says(clause_of(REASON, "Worker_TP0"), "waits")
    assert line_of("a: 1\nb: 2\n", "b") == "b: 2" and line_of("a: 1\n", "c") == ""
