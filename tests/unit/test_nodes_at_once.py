"""Every node asked at once: the stacks (`RemoteEvidence.capture_with`) and the context (`RemoteEvidence.context`)
of N nodes are asked in parallel, so a dead node costs its own call's timeout, not the sum. Fake links that wait at
a barrier all N calls must reach: asked one after another, the first never gets through (BrokenBarrierError)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from watchdog.config.load import Config
from watchdog.config.nodes import NodeSection
from watchdog.core.processes import Capture
from watchdog.evidence.collect.context import Context
from watchdog.nodes.remote import RemoteEvidence
from watchdog.nodes.transport import NodeError

NAMES = ("w1", "w2", "w3", "w4")


class Link:
    def __init__(self, name: str, barrier: threading.Barrier, dead: bool = False) -> None:
        self.name, self.barrier, self.dead = name, barrier, dead
        self.first = True

    def call(self, verb: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        if self.first:  # each node's first call (stacks, or context) waits for every other node's
            self.first = False
            self.barrier.wait(timeout=5)
        if self.dead:
            raise NodeError(self.name, "timeout", f"{verb}: no answer within 20s (the call was ended)")
        if verb == "context":
            return {"log_tail": f"{self.name} log\n", "log_source": "/var/log/vllm.log", "versions": {"watchdog": "1"}}
        if verb == "stacks":
            return {"capture": {"processes": [], "rounds": [[], []], "problems": []}, "wall": 0.0}
        return {"rings": []}


def evidence(dead: str = "", verbs: int = 1) -> RemoteEvidence:
    barrier = threading.Barrier(len(NAMES))
    cfg = Config(nodes=tuple(NodeSection(name=n, host="10.0.0.2", identity_file="/k", known_hosts_file="/h")
                             for n in NAMES))
    return RemoteEvidence(cfg, {n: Link(n, barrier, n == dead) for n in NAMES})  # type: ignore[misc]


def test_every_nodes_context_is_asked_at_once_and_a_dead_one_is_said_by_name() -> None:
    ctx = evidence(dead="w3").context(Context())
    assert [n for n, c in ctx.nodes.items() if c.reached] == ["w1", "w2", "w4"]
    assert not ctx.nodes["w3"].reached and ctx.nodes["w1"].log_tail == "w1 log\n"
    assert any(p.node == "w3" and "unreachable: no context" in p.text for p in ctx.problems), ctx.problems


@pytest.mark.parametrize("dead", ["", "w2"])
def test_every_nodes_stacks_are_asked_at_once(dead: str) -> None:
    cap = evidence(dead).capture_with(lambda: Capture((), ({}, {}), (), {}))
    reached = {n.node: n.reachable for n in cap.nodes}
    assert reached == {n: n != dead for n in NAMES}, reached
