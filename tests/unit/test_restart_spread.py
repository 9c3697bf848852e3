"""A restart step on many nodes at once (``nodes = [...]``): the plan's groups, the checks of the key, and the
Restarter running a group at once, every node's command to its end, stopping after a group in which one failed."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from watchdog.act.restart import Restarter
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.load import ConfigError, load
from watchdog.config.nodes import NodeSection
from watchdog.config.restart_plan import plan, shm_check_at
from watchdog.host.run import RunResult

WORKERS = ("w1", "w2", "w3")


def node(name: str, pre_start: tuple[str, ...] = ()) -> NodeSection:
    return NodeSection(name=name, host="10.0.0.2", identity_file="/k", known_hosts_file="/h", pre_start=pre_start)


def docker(action: str, on: Sequence[str], *names: str) -> StepSection:
    return StepSection(kind="docker", action=action, containers=names or ("vllm",), nodes=tuple(on), timeout=60)


# workers before head: stop everything at once, start the workers at once, then the head
ORDERED = (docker("stop", ("local", *WORKERS)), docker("start", WORKERS),
           StepSection(kind="docker", action="start", containers=("vllm",), timeout=60))


def grouped(section: RestartSection, nodes: Sequence[NodeSection] = ()) -> list[list[str]]:
    out: dict[int, list[str]] = {}
    for c in plan(section, nodes):
        out.setdefault(c.group, []).append(f"{c.description}@{c.node}")
    return list(out.values())


def test_a_step_on_several_nodes_is_one_group_and_the_hooks_due_before_it_run_together_before_its_start() -> None:
    nodes = [node("w1", ("/bin/w1",)), node("w2"), node("w3", ("/bin/w3",))]
    got = grouped(RestartSection(steps=ORDERED, pre_start=("/bin/h",)), nodes)
    assert got == [
        ["docker stop vllm@local", "docker stop vllm@w1", "docker stop vllm@w2", "docker stop vllm@w3"],
        ["pre-start hook on node w1@w1", "pre-start hook on node w3@w3"],
        ["docker start vllm@w1", "docker start vllm@w2", "docker start vllm@w3"],
        ["pre-start hook@local"], ["docker start vllm@local"]]
    assert shm_check_at(plan(RestartSection(steps=ORDERED), nodes)) == 4  # after every node's stop


def test_several_commands_of_a_spread_step_go_command_by_command_and_a_transient_unit_stops_everywhere_first() -> None:
    two = grouped(RestartSection(steps=(docker("start", ("w1", "w2"), "a", "b"),)), [node("w1"), node("w2")])
    assert two == [["docker start a@w1", "docker start a@w2"], ["docker start b@w1", "docker start b@w2"]]
    transient = StepSection(kind="command", argv=("/opt/serve",), transient_unit="vllm.service", nodes=("w1", "w2"))
    got = grouped(RestartSection(steps=(transient,)), [node("w1", ("/bin/w1",)), node("w2", ("/bin/w2",))])
    assert got == [["command stop vllm.service (its transient unit)@w1", "command stop vllm.service (its transient "
                    "unit)@w2"], ["pre-start hook on node w1@w1", "pre-start hook on node w2@w2"],
                   ["command /opt/serve as vllm.service@w1", "command /opt/serve as vllm.service@w2"]]


def test_one_node_steps_are_still_one_command_at_a_time() -> None:
    steps = (StepSection(kind="systemd", action="stop", units=("a", "b")),
             StepSection(kind="systemd", action="start", units=("a",), node="w1"))
    assert grouped(RestartSection(steps=steps), [node("w1")]) == [
        ["systemd stop a@local"], ["systemd stop b@local"], ["systemd start a@w1"]]


@pytest.mark.parametrize(("step", "said"), [
    ('node = "w1"\nnodes = ["w2"]', r"restart\.steps\[0\]: node and nodes both given"),
    ('nodes = ["w1", "w1"]', r"restart\.steps\[0\]\.nodes: a node named twice"),
    ('nodes = ["w1", "w9"]', r"restart\.steps\[0\]\.nodes\[1\]: unknown node 'w9' \(known: local, w1, w2"),
    ('nodes = "w1"', r"restart\.steps\[0\]\.nodes"),
])
def test_the_nodes_key_is_checked_with_the_key_named(tmp_path: Path, step: str, said: str) -> None:
    p = tmp_path / "w.toml"
    nodes = "".join(f'[[nodes]]\nname = "{n}"\nhost = "10.0.0.{i + 2}"\nidentity_file = "/k"\nknown_hosts_file = "/h"\n'
                    for i, n in enumerate(("w1", "w2")))
    p.write_text(f'[[restart.steps]]\nkind = "docker"\ncontainers = ["vllm"]\n{step}\n' + nodes)
    with pytest.raises(ConfigError, match=said):
        load(p)
    p.write_text('[[restart.steps]]\nkind = "docker"\ncontainers = ["vllm"]\nnodes = ["local", "w2"]\n' + nodes)
    assert load(p).restart.steps[0].on == ("local", "w2")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Node:
    """A node's runner: waits at a barrier every node of the group must reach (so a group run one node after another
    never gets through), then answers; ``fail`` fails its commands, after taking ``takes`` seconds."""

    def __init__(self, name: str, calls: list[str], lock: threading.Lock, barrier: threading.Barrier | None,
                 fail: bool = False) -> None:
        self.name, self.calls, self.lock, self.barrier, self.fail = name, calls, lock, barrier, fail
        self.timeouts: list[float] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        if self.barrier is not None and argv[1] == "stop":
            self.barrier.wait(timeout=5)  # BrokenBarrierError: the group did not run at once
        with self.lock:
            self.calls.append(f"{self.name}: {' '.join(argv)}")
            self.timeouts.append(timeout)
        rc = 1 if self.fail else 0
        return RunResult(tuple(argv), rc, 2.0, error="exit status 1" if rc else "", output="Error: no such container")


def restarter(fail: str = "") -> tuple[Restarter, list[str], dict[str, Node]]:
    calls: list[str] = []
    lock, barrier = threading.Lock(), threading.Barrier(4)
    runners = {n: Node(n, calls, lock, barrier, fail=n == fail) for n in ("local", *WORKERS)}
    r = Restarter(RestartSection(steps=ORDERED), runners, clock=Clock(), nodes=[node(n) for n in WORKERS])  # type: ignore[arg-type]
    return r, calls, runners


def test_a_group_runs_on_every_node_at_once_then_the_next_group() -> None:
    r, calls, runners = restarter()
    out = r.run()
    assert out.ok, out.failed
    stops, starts = calls[:4], calls[4:]
    assert sorted(stops) == [f"{n}: docker stop --time 54 vllm" for n in ("local", *WORKERS)]
    assert sorted(starts[:3]) == [f"{n}: docker start vllm" for n in WORKERS]
    assert starts[3] == "local: docker start vllm"
    assert all(t == 60 for n in runners.values() for t in n.timeouts)  # each node gets its step's whole time
    assert [s["node"] for s in out.steps] == ["local", *WORKERS, *WORKERS, "local"]  # records in the step's order


def test_a_failure_on_one_node_is_said_every_other_node_finishes_its_command_and_nothing_starts() -> None:
    r, calls, _ = restarter(fail="w2")
    out = r.run()
    assert not out.ok and out.failed == "docker stop vllm on node w2", out.failed
    assert out.error == "w2: exit status 1: Error: no such container", out.error
    assert sorted(calls) == sorted(f"{n}: docker stop --time 54 vllm" for n in ("local", *WORKERS))  # no start
    by_node = {s["node"]: s for s in out.steps}
    assert [n for n, s in by_node.items() if not s["ok"]] == ["w2"]
    assert "no such container" in by_node["w2"]["error"] and len(out.results) == 4
