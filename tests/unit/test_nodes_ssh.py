"""The transport and the agent against a real sshd (Debian's openssh-server) in network, PID and mount namespaces
of the test's own, with keys made here. Security: an unknown host key, a wrong key, a command outside the agent's
verbs, a restart action the node's config does not allow: each refused with a clear message, nothing run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.sshnode import SshNode, keygen
from watchdog.nodes.transport import NodeError, NodeLink

ALLOWED_MARK = "allowed-ran"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshNode]:
    root = tmp_path_factory.mktemp("sshnode")
    marks = root / "marks"
    marks.mkdir()
    toml = (f'audit_log = "{root}/node/agent.log"\nremove_shm = true\n'
            f'[[steps]]\nkind = "command"\nargv = ["touch", "{marks}/{ALLOWED_MARK}"]\n')
    n = SshNode(root, toml)
    n.marks = marks  # type: ignore[attr-defined]
    with n:
        yield n


@pytest.fixture
def link(node: SshNode) -> Iterator[NodeLink]:
    lk = NodeLink(node.section())
    yield lk
    lk.close()


def audit(node: SshNode) -> str:
    return node.audit_log.read_text() if node.audit_log.exists() else ""


def test_version_over_one_shared_connection(node: SshNode, link: NodeLink) -> None:
    v = link.call("version")
    assert v["ok"] and v["version"] and v["protocol"] == 1
    assert v["ptrace_allowed"] is True
    master = link._master
    assert master is not None and master.poll() is None
    link.call("list")
    assert link._master is master  # the second call went through the same connection


def test_unknown_host_key_is_refused_before_anything_runs(node: SshNode, tmp_path: Path) -> None:
    other = keygen(tmp_path / "other_host")
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{node.addr} {' '.join(other.split()[:2])}\n")
    before = audit(node)
    lk = NodeLink(node.section(known_hosts_file=str(kh)))
    with pytest.raises(NodeError) as e:
        lk.call("version")
    lk.close()
    assert e.value.kind == "host_key" and "host key verification failed" in e.value.message
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    lk = NodeLink(node.section(known_hosts_file=str(empty)))  # no trust on first use either
    with pytest.raises(NodeError) as e:
        lk.call("version")
    lk.close()
    assert e.value.kind == "host_key"
    assert audit(node) == before  # the agent never ran


def test_a_key_the_node_does_not_know_is_refused(node: SshNode, tmp_path: Path) -> None:
    keygen(tmp_path / "stranger")
    before = audit(node)
    lk = NodeLink(node.section(identity_file=str(tmp_path / "stranger")))
    with pytest.raises(NodeError) as e:
        lk.call("version")
    lk.close()
    assert e.value.kind == "auth" and "refused our key" in e.value.message
    assert audit(node) == before


def test_a_command_outside_the_verbs_is_refused_and_logged_there(node: SshNode, link: NodeLink) -> None:
    mark = node.marks / "shell-ran"  # type: ignore[attr-defined]
    proc = link.start(f"touch {mark}")
    out, _ = proc.communicate(b"", timeout=20)
    answer = json.loads(out)
    assert answer["ok"] is False and "only runs the watchdog agent's verbs" in answer["error"]
    assert proc.returncode == 2
    assert not mark.exists()
    assert f"refused command 'touch {mark}'" in audit(node)
    with pytest.raises(NodeError) as e:  # a verb with words after it is not a verb
        link.call("version; id")
    assert e.value.kind == "refused"


def test_only_the_restart_actions_the_node_allows_run(node: SshNode, link: NodeLink) -> None:
    marks: Path = node.marks  # type: ignore[attr-defined]
    with pytest.raises(NodeError) as e:
        link.call("run", {"argv": ["touch", str(marks / "not-allowed")], "timeout": 5})
    assert e.value.kind == "refused" and "not allowed by this node's config" in e.value.message
    assert not (marks / "not-allowed").exists()
    assert "not allowed by this node's config" in audit(node)
    r = link.call("run", {"argv": ["touch", str(marks / ALLOWED_MARK)], "timeout": 5})
    assert r["rc"] == 0 and (marks / ALLOWED_MARK).exists()


def test_a_hung_or_flooding_node_cannot_block_or_exhaust(node: SshNode, tmp_path: Path) -> None:
    """Other keys of the same node bound to a hostile forced command: the call ends at its timeout or its cap."""
    hang_pub = keygen(tmp_path / "hang")
    flood_pub = keygen(tmp_path / "flood")
    keys = node.dir / "authorized_keys"
    original = keys.read_text()
    keys.write_text(original + f'command="sleep 60",no-pty {hang_pub}\ncommand="yes",no-pty {flood_pub}\n')
    try:
        lk = NodeLink(node.section(identity_file=str(tmp_path / "hang")))
        t0 = time.monotonic()
        with pytest.raises(NodeError) as e:
            lk.call("version", timeout=1.5)
        hang_took = time.monotonic() - t0
        lk.close()
        assert e.value.kind == "timeout"
        lk = NodeLink(node.section(identity_file=str(tmp_path / "flood"), max_bytes=65536))
        with pytest.raises(NodeError) as e:
            lk.call("version", timeout=30)
        lk.close()
        assert e.value.kind == "too_big"
        assert hang_took < 30  # ended by its own 1.5 s limit, not the hung command's 60 s
    finally:
        keys.write_text(original)


def test_liveness_stream_sees_a_rank_stop_and_die(node: SshNode, link: NodeLink) -> None:
    fake = subprocess.Popen([*node.nsenter(), "bash", "-c", "exec -a VLLM::Worker_TP1 sleep 600"],
                            start_new_session=True)
    stream = None
    try:
        time.sleep(0.5)
        listed = link.call("list")["processes"]
        assert [p["title"] for p in listed] == ["VLLM::Worker_TP1"]
        inner = listed[0]["pid"]
        host_pid = [int(c) for c in Path(f"/proc/{fake.pid}/task/{fake.pid}/children").read_text().split()]
        target = host_pid[0] if host_pid else fake.pid
        stream = link.start("liveness")
        assert stream.stdin is not None and stream.stdout is not None
        stream.stdin.write(json.dumps({"interval": 0.3}).encode())
        stream.stdin.close()
        first = json.loads(stream.stdout.readline())
        assert first["ranks"] == [{"pid": inner, "title": "VLLM::Worker_TP1", "role": "worker", "state": "running"}]
        os.kill(target, 19)  # SIGSTOP
        states = [json.loads(stream.stdout.readline())["ranks"][0]["state"] for _ in range(4)]
        assert "stopped" in states
        os.killpg(fake.pid, 9)  # the rank and nsenter (which stopped itself with its child, as nsenter does)
        fake.wait(timeout=10)
        seen = [json.loads(stream.stdout.readline())["ranks"] for _ in range(4)]
        # its parent (nsenter) died with it: an orphan zombie until the namespace's PID 1 reaps it, then gone
        assert [(r["pid"], r["title"]) for r in seen[-1]] == [(inner, "VLLM::Worker_TP1")]
        assert seen[-1][0]["state"] in ("zombie", "gone")
    finally:
        if stream is not None:
            os.killpg(stream.pid, 9)
            stream.wait()
        if fake.poll() is None:
            os.killpg(fake.pid, 9)
            fake.wait()


def test_watchdog_nodes_command(node: SshNode, tmp_path: Path) -> None:
    cfg = tmp_path / "watchdog.toml"
    cfg.write_text(node.toml())
    r = subprocess.run([sys.executable, "-m", "watchdog", "nodes", "--config", str(cfg), "--json"],
                       capture_output=True, text=True, timeout=60, check=False)
    out = json.loads(r.stdout)
    # usable, but no engine runs on this node: exit 3, the finding named
    assert r.returncode == 3 and out["exit"] == 3, r.stdout + r.stderr
    assert out["nodes"][0]["reachable"] and out["nodes"][0]["host_key_verified"] and out["nodes"][0]["fine"]
    assert [f["code"] for f in out["nodes"][0]["findings"]] == ["no_engine_ranks"]
    bad = tmp_path / "bad.toml"
    (tmp_path / "kh").write_text("")
    bad.write_text(node.toml().replace(str(node.known_hosts), str(tmp_path / "kh")))
    r = subprocess.run([sys.executable, "-m", "watchdog", "nodes", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "host key verified NO" in r.stdout, r.stdout
