"""Restart across nodes: each node's pre-start hook placed before its own first starting step (or the first overall),
the /dev/shm check after the last stop and before the first start on every node (found and removed, names and
bytes, never a failed restart), the ``restart_steps`` event, and ``restart.remove_shm`` in the config. Runners,
sweepers and links are small fakes; the local sweeper runs on a real directory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_respond import Harness, config
from watchdog.act.incident_types import Phase
from watchdog.act.restart import Progress, RecoveryDone, Restarter, RestartOutcome, ShmReport
from watchdog.act.shm_sweep import LocalShm, NodeShm
from watchdog.config.act import RestartSection, StepSection
from watchdog.config.load import ConfigError, load
from watchdog.config.nodes import NodeSection
from watchdog.config.restart_plan import plan, shm_check_at
from watchdog.core.processes import EngineProcess
from watchdog.core.roles import Role
from watchdog.core.types import State
from watchdog.host.run import RunResult
from watchdog.nodes.ranks import RankTracker
from watchdog.nodes.transport import NodeError


def node(name: str, pre_start: tuple[str, ...] = (), timeout: float = 120.0) -> NodeSection:
    return NodeSection(name=name, host="10.0.0.2", identity_file="/k", known_hosts_file="/h", pre_start=pre_start,
                       pre_start_timeout=timeout)


def ctl(verb: str, role: str, where: str) -> StepSection:
    return StepSection(kind="command", action=verb, argv=("/opt/ctl", verb, role), node=where, timeout=60)


TWO = (ctl("stop", "head", "local"), ctl("stop", "worker", "w1"), ctl("start", "worker", "w1"),
       ctl("start", "head", "local"))


def described(section: RestartSection, nodes: Sequence[NodeSection] = ()) -> list[str]:
    return [f"{c.description}@{c.node}" for c in plan(section, nodes)]


# --- where the hooks go


def test_each_node_hook_runs_there_before_the_first_starting_step_on_that_node() -> None:
    """Command steps count as starting (what a command does cannot be known): a node whose first step is a stop
    command gets its hook before it; with systemd steps the stops are told apart."""
    steps = (StepSection(kind="systemd", action="stop", units=("vllm-head",)),
             StepSection(kind="systemd", action="stop", units=("vllm-worker",), node="w1"),
             StepSection(kind="systemd", action="start", units=("vllm-worker",), node="w1"),
             StepSection(kind="systemd", action="start", units=("vllm-head",)))
    section = RestartSection(steps=steps, pre_start=("/bin/drop",), pre_start_timeout=9)
    assert described(section, [node("w1", ("/bin/drop-w",), 7)]) == [
        "systemd stop vllm-head@local", "systemd stop vllm-worker@w1", "pre-start hook on node w1@w1",
        "systemd start vllm-worker@w1", "pre-start hook@local", "systemd start vllm-head@local"]
    hooks = [c for c in plan(section, [node("w1", ("/bin/drop-w",), 7)]) if c.kind == "pre-start"]
    assert [(c.node, c.argv, c.timeout, c.step) for c in hooks] == [("w1", ("/bin/drop-w",), 7, None),
                                                                    ("local", ("/bin/drop",), 9, None)]


def test_a_node_without_a_starting_step_of_its_own_gets_its_hook_before_the_first_start_overall() -> None:
    steps = (StepSection(kind="systemd", action="stop", units=("w",), node="w1"),
             StepSection(kind="systemd", action="restart", units=("h",)))
    nodes = [node("w1", ("/bin/w1",)), node("w2", ("/bin/w2",))]  # w1: a stop only; w2: no step at all
    assert described(RestartSection(steps=steps, pre_start=("/bin/h",)), nodes) == [
        "systemd stop w@w1", "pre-start hook@local", "pre-start hook on node w1@w1", "pre-start hook on node w2@w2",
        "systemd restart h@local"]


def test_command_steps_that_say_stop_or_start_place_hooks_like_systemd_steps() -> None:
    section = RestartSection(steps=TWO, pre_start=("/bin/h",))
    assert described(section, [node("w1", ("/bin/w",))]) == [
        "command /opt/ctl@local", "command /opt/ctl@w1", "pre-start hook on node w1@w1", "command /opt/ctl@w1",
        "pre-start hook@local", "command /opt/ctl@local"]
    assert shm_check_at(plan(section)) == 2


def test_command_steps_that_do_not_say_count_as_starting_and_stop_only_plans_run_no_hook() -> None:
    unsaid = tuple(StepSection(kind="command", argv=s.argv, node=s.node) for s in TWO)
    assert described(RestartSection(steps=unsaid, pre_start=("/bin/h",)), [node("w1", ("/bin/w",))]) == [
        "pre-start hook@local", "command /opt/ctl@local", "pre-start hook on node w1@w1", "command /opt/ctl@w1",
        "command /opt/ctl@w1", "command /opt/ctl@local"]
    assert shm_check_at(plan(RestartSection(steps=unsaid))) is None  # may stop and start in one: no check
    stops = (StepSection(kind="docker", action="stop", containers=("c",), node="w1"),)
    assert described(RestartSection(steps=stops, pre_start=("/bin/h",)), [node("w1", ("/bin/w",))]) == \
        ["docker stop c@w1"]


def test_without_nodes_the_plan_is_the_single_host_plan() -> None:
    steps = (StepSection(kind="systemd", action="stop", units=("u",)),
             StepSection(kind="systemd", action="start", units=("u",)))
    section = RestartSection(steps=steps, pre_start=("/bin/h",))
    assert plan(section) == plan(section, [node("w1")])  # a node without a hook adds nothing
    assert described(section) == ["systemd stop u@local", "pre-start hook@local", "systemd start u@local"]


def test_the_shm_check_goes_after_the_last_stop_and_before_the_first_start_or_hook() -> None:
    steps = (StepSection(kind="systemd", action="stop", units=("a", "b")),
             StepSection(kind="systemd", action="start", units=("a",)))
    assert shm_check_at(plan(RestartSection(steps=steps))) == 2
    assert shm_check_at(plan(RestartSection(steps=steps, pre_start=("/bin/h",)))) == 2  # the hook is at 2
    assert shm_check_at(plan(RestartSection(steps=steps[:1]))) == 2  # nothing starts: after the last
    # a restart step stops and starts in one: nothing is stale before it, the new engine's segments are being made
    # after it: no check (said in the restart's record), never a removal racing the new engine
    assert shm_check_at(plan(RestartSection(steps=(StepSection(kind="systemd", action="restart", units=("a",)),)))) \
        is None


# --- running it


class Log:
    def __init__(self) -> None:
        self.calls: list[str] = []


class Runner:
    def __init__(self, log: Log, name: str, fail: str = "") -> None:
        self.log, self.name, self.fail = log, name, fail
        self.timeouts: list[float] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        self.log.calls.append(f"{self.name}: {' '.join(argv)}")
        self.timeouts.append(timeout)
        rc = 1 if self.fail and self.fail in argv else 0
        return RunResult(tuple(argv), rc, 0.5, error="exit status 1" if rc else "")


class Sweep:
    def __init__(self, log: Log, report: ShmReport | None = None, boom: bool = False) -> None:
        self.log, self.report, self.boom = log, report, boom

    def __call__(self) -> ShmReport:
        self.log.calls.append("shm check")
        if self.boom:
            raise RuntimeError("the sweeper itself broke")
        assert self.report is not None
        return self.report


def two_node_restarter(log: Log, fail: str = "", **sweep: Any) -> Restarter:
    section = RestartSection(steps=TWO, pre_start=("/bin/h",))
    worker = ShmReport("w1", stale=(("psm_1", 4096), ("sem.mp-x", 32)), removed=(("psm_1", 4096), ("sem.mp-x", 32)))
    return Restarter(section, {"local": Runner(log, "local"), "w1": Runner(log, "w1", fail)},
                     nodes=[node("w1", ("/bin/w",))],
                     sweepers={"local": Sweep(log, ShmReport("local", in_use=3)), "w1": Sweep(log, worker, **sweep)})


def test_restart_runs_each_command_on_its_node_with_the_shm_check_between_the_stops_and_the_starts() -> None:
    log = Log()
    out = two_node_restarter(log).run()
    assert out.ok
    assert log.calls == ["local: /opt/ctl stop head", "w1: /opt/ctl stop worker", "shm check", "shm check",
                         "w1: /bin/w", "w1: /opt/ctl start worker", "local: /bin/h", "local: /opt/ctl start head"]
    assert [(s["what"], s["node"]) for s in out.steps] == [
        ("command /opt/ctl", "local"), ("command /opt/ctl", "w1"), ("shm check", "local"), ("shm check", "w1"),
        ("pre-start hook on node w1", "w1"), ("command /opt/ctl", "w1"), ("pre-start hook", "local"),
        ("command /opt/ctl", "local")]
    w1 = out.shm[1].record()
    assert w1["stale"] == [{"name": "psm_1", "bytes": 4096}, {"name": "sem.mp-x", "bytes": 32}]
    assert (w1["stale_bytes"], w1["removed_bytes"], out.shm[0].record()["in_use"]) == (4128, 4128, 3)


def test_a_failed_or_broken_shm_check_is_reported_and_the_restart_goes_on() -> None:
    log = Log()
    out = two_node_restarter(log, boom=True).run()
    assert out.ok and out.shm[1].error == "RuntimeError: the sweeper itself broke"
    assert next(s for s in out.steps if s["what"] == "shm check" and not s["ok"])["node"] == "w1"


def test_a_failed_hook_on_a_node_ends_the_restart_before_that_node_starts() -> None:
    log = Log()
    out = two_node_restarter(log, fail="/bin/w").run()
    assert not out.ok and out.failed == "pre-start hook on node w1"
    assert log.calls[-1] == "w1: /bin/w"


def test_each_hook_has_its_own_timeout() -> None:
    section = RestartSection(steps=(StepSection(kind="command", argv=("/up",), node="w1"),), pre_start=("/h",),
                             pre_start_timeout=11)
    log = Log()
    local, w1 = Runner(log, "local"), Runner(log, "w1")
    ticks = iter(range(0, 1000, 5))
    Restarter(section, {"local": local, "w1": w1}, clock=lambda: float(next(ticks)),
              nodes=[node("w1", ("/w",), 7)]).run()
    assert log.calls == ["local: /h", "w1: /w", "w1: /up"]
    assert local.timeouts == [11] and w1.timeouts[0] == 7  # not what was left of the head's hook


# --- the sweepers


def test_local_shm_reports_stale_segments_and_removes_them_only_when_configured(tmp_path: Path) -> None:
    (tmp_path / "psm_dead").write_bytes(b"x" * 1000)
    (tmp_path / "sem.mp-old").write_bytes(b"y" * 32)
    (tmp_path / "other").write_bytes(b"z")  # not an engine's: never listed
    held = open(tmp_path / "psm_live", "wb")  # noqa: SIM115 - held open across the check: in use
    try:
        held.write(b"l" * 10)
        held.flush()
        report = LocalShm(remove=False, shm_dir=str(tmp_path))()
        assert (sorted(report.stale), report.removed, report.in_use) == ([("psm_dead", 1000), ("sem.mp-old", 32)],
                                                                         (), 1)
        assert (tmp_path / "psm_dead").exists()
        report = LocalShm(remove=True, shm_dir=str(tmp_path))()
        assert sorted(report.removed) == [("psm_dead", 1000), ("sem.mp-old", 32)] and not report.error
        assert sorted(os.listdir(tmp_path)) == ["other", "psm_live"]
    finally:
        held.close()


class FakeLink:
    def __init__(self, answers: list[dict[str, Any] | NodeError]) -> None:
        self.answers, self.asked = answers, []
        self.node = NodeSection(name="w1")

    def call(self, verb: str, args: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        self.asked.append((verb, args))
        a = self.answers.pop(0)
        if isinstance(a, NodeError):
            raise a
        return a


def test_node_shm_lists_then_removes_through_the_agent_and_keeps_the_sizes() -> None:
    listed = {"segments": [{"name": "psm_a", "bytes": 100, "in_use": False},
                           {"name": "psm_b", "bytes": 7, "in_use": True}], "removed": []}
    link = FakeLink([listed, {"segments": [{"name": "psm_b", "bytes": 7, "in_use": True}], "removed": ["psm_a"]}])
    report = NodeShm(link, remove=True)()  # type: ignore[arg-type]
    assert link.asked == [("shm", {"remove": False}), ("shm", {"remove": True})]
    assert (report.stale, report.removed, report.in_use, report.error) == ((("psm_a", 100),), (("psm_a", 100),), 1, "")
    link = FakeLink([listed])
    assert NodeShm(link, remove=False)().removed == ()  # type: ignore[arg-type]
    assert link.asked == [("shm", {"remove": False})]


def test_node_shm_that_cannot_be_reached_or_refuses_is_a_report_not_an_exception() -> None:
    link = FakeLink([NodeError("w1", "unreachable", "shm: cannot reach the node: no route to host")])
    assert NodeShm(link, remove=True)().error == "on node w1: shm: cannot reach the node: no route to host"  # type: ignore[arg-type]
    listed = {"segments": [{"name": "psm_a", "bytes": 1, "in_use": False}]}
    link = FakeLink([listed, NodeError("w1", "refused", "shm: removing /dev/shm segments is not allowed")])
    report = NodeShm(link, remove=True)()  # type: ignore[arg-type]
    assert "not allowed" in report.error and report.removed == ()


# --- the event, the config


def test_restart_steps_event_says_what_ran_and_what_shm_held_once(tmp_path: Path) -> None:
    h = Harness(tmp_path, config())
    h.step(State.DOWN, since_ago=11)
    assert h.names()[-1] == "restart_started"
    outcome = RestartOutcome(True, (), steps=({"what": "command /opt/ctl", "node": "w1", "ok": True},),
                             shm=(ShmReport("w1", (("psm_1", 10),), (("psm_1", 10),)),))
    h.recovery.progress = Progress(Phase.PROVING, h.clock.wall, outcome=outcome)
    h.step(State.DOWN)
    h.step(State.DOWN)
    ev = [e for e in h.events if e["event"] == "restart_steps"]
    assert len(ev) == 1 and ev[0]["steps"][0]["node"] == "w1"
    assert ev[0]["shm"][0]["removed"] == [{"name": "psm_1", "bytes": 10}]
    h.recovery.done = RecoveryDone(h.recovery.jobs[-1], True, "ready", "ok", h.clock.wall, 1.0, outcome)
    h.recovery.progress = None
    h.step(State.IDLE)
    assert [e["event"] for e in h.events].count("restart_steps") == 1 and "recovered" in h.names()


def test_restart_steps_event_when_the_steps_failed(tmp_path: Path) -> None:
    h = Harness(tmp_path, config())
    h.step(State.DOWN, since_ago=11)
    outcome = RestartOutcome(False, (), "command /opt/ctl", steps=({"what": "command /opt/ctl", "ok": False},))
    h.recovery.done = RecoveryDone(h.recovery.jobs[-1], False, "steps", "command /opt/ctl: exit status 1",
                                   outcome=outcome)
    h.step(State.DOWN)
    assert h.names()[-3:-1] == ["restart_steps", "restart_failed"]  # then backoff: restart_not_run


def test_restart_remove_shm_is_a_checked_bool(tmp_path: Path) -> None:
    p = tmp_path / "w.toml"
    p.write_text("[restart]\nremove_shm = true\n")
    assert load(str(p)).restart.remove_shm is True
    p.write_text('[restart]\nremove_shm = "yes"\n')
    with pytest.raises(ConfigError, match="remove_shm"):
        load(str(p))


# --- a restarted rank is seen again within seconds


def test_a_rank_gone_is_looked_for_again_every_few_seconds_not_only_every_rediscovery() -> None:
    now = [0.0]
    found: list[list[EngineProcess]] = [[EngineProcess(os.getpid(), Role.WORKER, "VLLM::Worker_TP1", {"tp": 1})]]
    tracker = RankTracker(lambda: found[0], rediscover_every=30.0, clock=lambda: now[0])
    tracker.poll()
    tracker.known = {999_999_999: next(iter(tracker.known.values()))}  # its pid is gone now
    found[0] = []
    now[0] = 2.0
    assert [r["state"] for r in tracker.poll()] == ["gone"]
    found[0] = [EngineProcess(os.getpid(), Role.WORKER, "VLLM::Worker_TP1", {"tp": 1})]  # the restart's successor
    now[0] = 7.5
    assert [r["state"] for r in tracker.poll()] == ["running"]


def test_a_lost_rank_names_itself_first_in_a_down_the_head_saw_too() -> None:
    from watchdog.core.types import Verdict
    from watchdog.nodes.liveness import NodeView, overlay
    from watchdog.nodes.protocol import RankState

    lost = NodeView("w1", "rank_lost", "VLLM::Worker_TP1 (pid 15) exited on node w1",
                    (RankState(15, "VLLM::Worker_TP1", "worker", "gone"),))
    down = Verdict("0", State.DOWN, "nothing listening (connection refused)", 10.0, 12.0)
    working = Verdict("0", State.WORKING, "running=2", 5.0, 12.0)
    assert [(v.state, v.reason) for v in overlay([down, working], [lost])] == [
        (State.DOWN, "VLLM::Worker_TP1 (pid 15) exited on node w1; nothing listening (connection refused)"),
        (State.DOWN, "VLLM::Worker_TP1 (pid 15) exited on node w1")]
    assert overlay([down], [])[0] == down


def test_a_node_not_seen_makes_a_frozen_engine_blind_too_never_an_incident() -> None:
    from watchdog.core.types import Verdict
    from watchdog.nodes.liveness import NodeView, overlay

    blind = NodeView("w1", "blind", "cannot see node w1: no liveness report for 6s")
    frozen = Verdict("0", State.FROZEN, "stacks confirm: every rank parked", 10.0, 12.0)
    down = Verdict("0", State.DOWN, "nothing listening (connection refused)", 10.0, 12.0)
    assert [(v.state, v.reason) for v in overlay([frozen, down], [blind])] == [
        (State.BLIND, "cannot see node w1: no liveness report for 6s; stacks confirm: every rank parked"),
        (State.DOWN, "nothing listening (connection refused)")]


def test_the_act_stage_plans_each_node_hook_and_checks_shm_on_every_node(tmp_path: Path) -> None:
    from watchdog.act.shm_sweep import LocalShm, NodeShm
    from watchdog.scrape.engine_http import EngineHTTP
    from watchdog.service.compose import Clock, Hooks, compose

    p = tmp_path / "w.toml"
    p.write_text('[restart]\npre_start = ["/bin/h"]\n'
                 '[[restart.steps]]\nkind = "command"\naction = "stop"\nargv = ["/stop"]\nnode = "w1"\n'
                 '[[restart.steps]]\nkind = "command"\naction = "start"\nargv = ["/start"]\nnode = "w1"\n'
                 '[[nodes]]\nname = "w1"\nhost = "10.0.0.2"\nidentity_file = "/k"\nknown_hosts_file = "/h"\n'
                 'pre_start = ["/bin/w"]\nremove_shm = true\n[gpu]\nenabled = false\n[capture]\nenabled = false\n')
    cfg = load(str(p))
    http = EngineHTTP(cfg.engine.url)

    def nothing(*_a: object) -> None:
        return None

    parts = compose(cfg, tmp_path, http, Hooks(nothing, nothing, nothing, nothing), Clock(), once=False)
    try:
        assert parts.responder is not None and parts.recovery is not None
        assert [line.split(" (")[0] for line in parts.responder.plan] == [
            "command /stop", "pre-start hook", "pre-start hook on node w1", "command /start"]
        restarter = parts.recovery.restarter
        assert restarter is not None
        sweepers = restarter.sweepers
        assert list(sweepers) == ["local", "w1"] and isinstance(sweepers["local"], LocalShm)
        assert isinstance(sweepers["w1"], NodeShm) and sweepers["w1"].remove and not sweepers["local"].remove
        # the restart's commands and its sweep run over the node's one shared link, the one the parts own
        links = parts.links
        assert sweepers["w1"].link is links["w1"] and restarter.runners["w1"].link is links["w1"]
    finally:
        parts.close()
        http.close()
