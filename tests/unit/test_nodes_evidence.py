"""Each node's own evidence, against a real sshd in network, PID and mount namespaces of the test's own
(`tests/harness/sshnode.py`):

- the log: the head's ``[[nodes]]`` entry says which log it wants; the node's agent reads it only if its own config
  allows exactly that source (else refuses, said in the answer and its audit log); an entry naming none gets the
  node's own; the bundle holds each node's own tail (``log-tail-<node>.txt``);
- ``watchdog dump --json`` per node: processes with their node, dumps, clock offset, log, problems ("node worker2:
  unreachable"), and whether that node's evidence is complete, partial or missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.facts import line_of, says
from tests.harness.sshnode import SshNode
from tests.unit.test_layout import IO, reach
from watchdog.config.load import Config, load
from watchdog.core.processes import Capture, Dump, EngineProcess, NodeReach, Problem
from watchdog.core.roles import Role
from watchdog.evidence.bundle.per_node import node_lines, per_node
from watchdog.evidence.collect.context import RING_WARNING, Context
from watchdog.nodes.protocol import LogRefused, ProtocolError, choose_log
from watchdog.nodes.remote import RemoteEvidence
from watchdog.nodes.transport import close_links, open_links

RANK = "import time\nwhile True:\n    time.sleep(0.2)\n"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshNode]:
    root = tmp_path_factory.mktemp("sshnode-evidence")
    engine_log = root / "engine-worker.log"
    engine_log.write_text("".join(f"worker line {i}\n" for i in range(50)) + f"WARNING {RING_WARNING} (60s)\n")
    n = SshNode(root, f'audit_log = "{root}/node/agent.log"\nlog_file = "{engine_log}"\n')
    n.engine_log = engine_log  # type: ignore[attr-defined]
    with n:
        # a python "rank" inside the node: py-spy reads it like a real one
        rank = subprocess.Popen([*n.nsenter(), "bash", "-c", f"exec -a VLLM::Worker_TP1 {sys.executable} -c '{RANK}'"],
                                start_new_session=True)
        try:
            time.sleep(0.5)
            yield n
        finally:
            os.killpg(rank.pid, signal.SIGKILL)
            rank.wait(timeout=10)


def config(node: SshNode, tmp_path: Path, log: str = "", extra: str = "") -> Config:
    p = tmp_path / "watchdog.toml"
    p.write_text("[capture]\ngap = 0.5\n" + node.toml() + log + extra)
    return load(p)


def context_of(node: SshNode, tmp_path: Path, log: str = "") -> Context:
    cfg = config(node, tmp_path, log)
    links = open_links(cfg.nodes)
    try:
        return RemoteEvidence(cfg, links).context(Context(log_tail="ours\n", log_source="/var/log/ours.log"))
    finally:
        close_links(links)


def test_choose_log_is_one_rule() -> None:
    own = {"journal_unit": "", "docker_container": "", "log_file": "/var/log/vllm.log"}
    assert choose_log({}, own) == ("log_file", "/var/log/vllm.log")  # the head names none: the node's own
    assert choose_log(None, own) == ("log_file", "/var/log/vllm.log")
    assert choose_log({"log_file": "/var/log/vllm.log"}, own) == ("log_file", "/var/log/vllm.log")
    with pytest.raises(LogRefused, match=r"asks for log_file '/etc/shadow', but this node's config allows only "
                                         r"log_file '/var/log/vllm.log'"):
        choose_log({"log_file": "/etc/shadow"}, own)
    with pytest.raises(LogRefused, match=r"journal_unit 'vllm\.service'"):
        choose_log({"journal_unit": "vllm.service"}, own)  # same engine, another kind of source: still not this one
    with pytest.raises(LogRefused, match="allows no log"):
        choose_log({"journal_unit": "vllm.service"}, {"journal_unit": "", "log_file": ""})
    assert choose_log({}, {"journal_unit": ""}) == ("", "")
    for bad in ("x", {"log_file": 3}, {"command": "cat /etc/shadow"}, {"log_file": "a", "journal_unit": "b"}):
        with pytest.raises(ProtocolError) as e:
            choose_log(bad, own)
        assert not isinstance(e.value, LogRefused)  # malformed: the whole request is refused


def test_the_head_names_the_nodes_own_log_and_gets_it(node: SshNode, tmp_path: Path) -> None:
    path = node.engine_log  # type: ignore[attr-defined]
    ctx = context_of(node, tmp_path, f'log_file = "{path}"\n')
    nc = ctx.nodes["worker1"]
    assert nc.reached and nc.log_source == str(path) and "worker line 49" in nc.log_tail
    assert "worker line 0\n" not in nc.log_tail or len(nc.log_tail.splitlines()) <= 200
    assert ctx.log_tail == "ours\n" and ctx.log_source == "/var/log/ours.log"  # ours stays ours
    assert ctx.ring_warnings == 1  # counted in the node's tail
    assert nc.versions["watchdog"] and ctx.versions["watchdog (node worker1)"] == nc.versions["watchdog"]
    assert not [p for p in ctx.problems if p.node == "worker1"]


def test_the_head_naming_no_log_gets_the_nodes_own(node: SshNode, tmp_path: Path) -> None:
    nc = context_of(node, tmp_path).nodes["worker1"]
    assert nc.log_source == str(node.engine_log) and "worker line 49" in nc.log_tail  # type: ignore[attr-defined]


def test_another_log_than_the_node_allows_is_refused_there(node: SshNode, tmp_path: Path) -> None:
    before = node.audit_log.read_text() if node.audit_log.exists() else ""
    ctx = context_of(node, tmp_path, 'log_file = "/etc/shadow"\n')
    nc = ctx.nodes["worker1"]
    assert nc.reached and nc.log_tail == "" and nc.log_source == ""
    refusal = Problem(f"log refused: the head asks for log_file '/etc/shadow', but this node's config allows only "
                      f"log_file '{node.engine_log}'", "worker1")  # type: ignore[attr-defined]
    assert refusal in ctx.problems and nc.problems == (refusal,)
    assert nc.versions["watchdog"]  # the rest of the context still comes
    records = [json.loads(x) for x in node.audit_log.read_text()[len(before):].splitlines()]
    assert [r["asked"] for r in records if r["event"] == "log refused"] == [{"log_file": "/etc/shadow"}]
    ctx = context_of(node, tmp_path, 'journal_unit = "vllm-worker.service"\n')
    assert any("asks for journal_unit 'vllm-worker.service'" in p.text for p in ctx.problems)


def test_a_node_that_allows_no_log_refuses_every_log(node: SshNode, tmp_path: Path) -> None:
    original = node.agent_config.read_text()
    node.agent_config.write_text("\n".join(x for x in original.splitlines() if not x.startswith("log_file")) + "\n")
    try:
        ctx = context_of(node, tmp_path, f'log_file = "{node.engine_log}"\n')  # type: ignore[attr-defined]
        assert any("this node's config allows no log" in p.text for p in ctx.problems), ctx.problems
        assert ctx.nodes["worker1"].log_tail == ""
        assert context_of(node, tmp_path).nodes["worker1"].log_source == ""  # none named, none there: no log
    finally:
        node.agent_config.write_text(original)


def test_dump_json_says_per_node_what_was_captured(node: SshNode, tmp_path: Path) -> None:
    """The dump runs in a PID namespace of its own: its /proc sees nothing, so every rank it reports came from the
    node; worker2 is a node nothing answers for."""
    unreachable = (f'[[nodes]]\nname = "worker2"\nhost = "127.0.0.1"\nport = 1\nidentity_file = "{node.dir}/client_key"'
                   f'\nknown_hosts_file = "{node.known_hosts}"\nconnect_timeout = 2.0\n')
    cfg = tmp_path / "watchdog.toml"
    cfg.write_text(f'[state]\ndir = "{tmp_path}/state"\n[capture]\ngap = 0.5\n' + node.toml()
                   + f'log_file = "{node.engine_log}"\n' + unreachable)  # type: ignore[attr-defined]
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "watchdog", "dump", "--config",
            str(cfg), "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "out")]
    r = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120, check=False)
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["complete"] is False, r.stderr[-2000:]  # a node's evidence is missing
    nodes = out["nodes"]
    assert list(nodes) == ["local", "worker1", "worker2"]
    w1, w2 = nodes["worker1"], nodes["worker2"]
    assert [(p["title"], p["role"]) for p in w1["processes"]] == [("VLLM::Worker_TP1", "worker")]
    assert w1["dumps"] == {"ok": 2, "failed": 0} and w1["stacks"] == "all" and w1["evidence"] == "complete"
    assert w1["reachable"] is True and abs(w1["clock_offset_s"]) < 0.3  # one machine: one clock
    assert w1["log_source"] == str(node.engine_log) and w1["log_lines"] == 51  # type: ignore[attr-defined]
    assert w1["versions"]["watchdog"] and w1["problems"] == []
    assert w2["reachable"] is False and w2["evidence"] == "missing" and w2["processes"] == []
    assert {p.split(": ")[2] for p in w2["problems"]} == {"no stacks", "no context"}, w2["problems"]
    assert all(p.startswith("node worker2: unreachable: ") and "cannot reach the node" in p for p in w2["problems"])
    assert nodes["local"]["evidence"] == "missing" and nodes["local"]["processes"] == []
    [proc] = out["processes"]
    assert proc["node"] == "worker1" and proc["pid"] == w1["processes"][0]["pid"]
    assert "log-tail-worker1.txt" in out["files"]
    bundle = Path(out["bundle"])
    assert "worker line 49" in (bundle / "log-tail-worker1.txt").read_text()
    assert "node worker2: evidence MISSING" in (bundle / "summary.md").read_text()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    worker1 = line_of(r.stdout, "worker1", "COMPLETE")
    assert says(worker1, "1 processes", "2 dumps ok", "0 failed", "clock offset"), r.stdout
    assert "node worker2: evidence MISSING" in r.stdout and "NOT REACHED" in r.stdout


def test_per_node_is_pure_and_names_what_is_missing() -> None:
    bad = {dep for dep in reach("watchdog.evidence.bundle.per_node") if dep.split(".")[0] in IO or dep in IO}
    assert not bad
    local = EngineProcess(11, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})
    remote = EngineProcess(11, Role.WORKER, "VLLM::Worker_TP1 on node w1", {"TP": 1}, node="w1")  # the same pid
    ok = Dump(11, 0.0, True, "[]")
    capture = Capture((local, remote), ({local.id: ok, remote.id: Dump(11, 0.0, False, "", "timeout")},),
                      nodes=(NodeReach("w1", 1, -0.25, True), NodeReach("w2", 0, None, False)))
    # which node a problem is of is its field, never its text ("node w1: ..." said by this host stays this host's)
    nodes = per_node(capture, {}, [Problem("unreachable: no stacks: timed out", "w2"), Problem("pid 11: timeout", "w1"),
                                   Problem("py-spy missing"), Problem("node w1: its log names this host")])
    assert nodes["local"]["evidence"] == "complete"
    assert nodes["local"]["problems"] == ["node w1: its log names this host", "py-spy missing"]
    assert nodes["w1"]["evidence"] == "missing" and nodes["w1"]["dumps"] == {"ok": 0, "failed": 1}
    assert nodes["w1"]["processes"] == [{"pid": 11, "role": "worker", "ranks": {"TP": 1},
                                         "title": "VLLM::Worker_TP1"}]
    assert nodes["w1"]["problems"] == ["node w1: pid 11: timeout"]
    assert nodes["w2"]["reachable"] is False
    assert nodes["w2"]["problems"] == ["node w2: unreachable: no stacks: timed out"]
    lines = node_lines(nodes)
    assert lines[1].startswith("node w1: evidence MISSING: 1 processes, 0 dumps ok, 1 failed, clock offset -0.250 s")
    assert "NOT REACHED" in lines[2]
