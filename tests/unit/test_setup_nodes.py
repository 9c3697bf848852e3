"""`watchdog nodes init` and what `watchdog nodes` says is wrong: the pure texts (fingerprints, known_hosts in its
``[host]:port`` form, the authorized_keys line, agent.toml with every key, the [[nodes]] entry), the findings with
their fixes, this host's side of the check (key mode, known_hosts entry) and the agent saying its audit log cannot
be written, in its answer. The path against a real sshd: tests/engine/test_two_nodes_setup.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.sshnode import keygen
from watchdog import __version__
from watchdog.cli.main import main
from watchdog.cli.nodes import EXIT_FINE, EXIT_NO_RANKS, EXIT_PROBLEM, exit_status, local_facts
from watchdog.config.load import load
from watchdog.config.nodes import NodeSection
from watchdog.nodes import enrol
from watchdog.nodes.agent_config import AgentConfig, AgentKeys, load_agent_config
from watchdog.nodes.findings import LocalFacts, Where, answer_findings, call_findings, local_findings

DOC = Path(__file__).resolve().parents[2] / "docs" / "two-nodes.md"
WHERE = Where("worker1", "10.0.0.2", "root", 2222, "/k/id", "/k/known_hosts")


def test_fingerprint_is_the_one_ssh_keygen_prints(tmp_path: Path) -> None:
    pub = keygen(tmp_path / "k")
    printed = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "k.pub")], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()[1]
    key = enrol.parse_public_key(pub)
    assert key.fingerprint == printed and key.kind == "ssh-ed25519"
    assert enrol.normal_fingerprint(printed.removeprefix("SHA256:") + "=") == printed


@pytest.mark.parametrize("bad", ["", "ssh-ed25519", "nonsense AAAA", "ssh-ed25519 !!!notbase64",
                                 "ssh-rsa AAAAC3NzaC1lZDI1NTE5AAAAIByvjmtGO/Kgx03QGtSvs2FTmOV61Hp5oA9TVI9M7SKW",
                                 "ssh-ed25519 AAAA x\nssh-ed25519 AAAA y"])
def test_a_bad_public_key_is_refused_with_the_reason(bad: str) -> None:
    with pytest.raises(ValueError, match=r"\w"):
        enrol.parse_public_key(bad)


def test_known_hosts_uses_the_bracket_form_off_port_22(tmp_path: Path) -> None:
    key = enrol.parse_public_key(keygen(tmp_path / "h"))
    assert enrol.known_hosts_line("10.0.0.2", 22, key).startswith("10.0.0.2 ssh-ed25519 ")
    line = enrol.known_hosts_line("10.0.0.2", 2222, key)
    assert line.startswith("[10.0.0.2]:2222 ssh-ed25519 ")
    (tmp_path / "kh").write_text(line)
    found = subprocess.run(["ssh-keygen", "-F", "[10.0.0.2]:2222", "-f", str(tmp_path / "kh")], capture_output=True,
                           timeout=30, check=False)
    assert found.returncode == 0  # ssh itself looks the node up by that form


def test_keyscan_match_takes_only_the_confirmed_key(tmp_path: Path) -> None:
    a, b = (enrol.parse_public_key(keygen(tmp_path / n)) for n in ("a", "b"))
    scanned = f"# 10.0.0.2:22 SSH-2.0-OpenSSH_9\n10.0.0.2 {a.line()}\n10.0.0.2 {b.line()}\ngarbage\n"
    keys = enrol.keyscan_keys(scanned)
    assert enrol.pick_by_fingerprint(keys, b.fingerprint).line() == b.line()
    other = enrol.parse_public_key(keygen(tmp_path / "c"))
    with pytest.raises(ValueError, match="not trusted") as e:
        enrol.pick_by_fingerprint(keys, other.fingerprint)
    assert a.fingerprint in str(e.value) and b.fingerprint in str(e.value)
    with pytest.raises(ValueError, match="SHA256"):
        enrol.pick_by_fingerprint(keys, "MD5:aa:bb")


def test_authorized_keys_line_is_restricted_to_the_agent(tmp_path: Path) -> None:
    key = enrol.parse_public_key(keygen(tmp_path / "k"))
    line = enrol.authorized_keys_line(key, "/opt/engine-watchdog/.venv/bin/python", from_="10.0.0.1")
    assert line.startswith('restrict,from="10.0.0.1",command="/opt/engine-watchdog/.venv/bin/python -m '
                           'watchdog.nodes.agent --config /etc/engine-watchdog/agent.toml" ssh-ed25519 ')
    for bad in ("relative/python", "/opt/my python", '/opt/x"y', "/opt/x;rm"):
        with pytest.raises(ValueError, match="absolute path"):
            enrol.authorized_keys_line(key, bad)
    with pytest.raises(ValueError, match="--from"):
        enrol.authorized_keys_line(key, "/usr/bin/python3", from_='1.2.3.4" ,command="sh')


def test_agent_toml_has_every_key_at_its_default_and_loads(tmp_path: Path) -> None:
    assert [k for k, _, _ in enrol.AGENT_KEYS] == [f.name for f in dataclasses.fields(AgentKeys)]
    path = tmp_path / "agent.toml"
    path.write_text(enrol.agent_toml("worker1", "head"))
    cfg = load_agent_config(str(path))
    assert dataclasses.replace(cfg, source="x") == dataclasses.replace(AgentConfig(), source="x")


def test_the_doc_explains_every_agent_key() -> None:
    text = DOC.read_text()
    for key, _, _ in enrol.AGENT_KEYS:
        assert re.search(rf"^\| `{key}` \|", text, re.M), key


def test_findings_say_what_is_wrong_with_a_fix() -> None:
    codes = [f.code for f in local_findings(WHERE, LocalFacts(key="mode", key_mode=0o644, known_hosts="unknown"))]
    assert codes == ["key_mode", "host_key_unknown"]
    unknown = local_findings(WHERE, LocalFacts(known_hosts="unknown"))[0]
    assert "[10.0.0.2]:2222" in unknown.problem and "--port 2222" in unknown.fix
    assert "chmod 600 /k/id" in local_findings(WHERE, LocalFacts(key="mode", key_mode=0o644))[0].fix
    assert LocalFacts(key="missing").blocking and not LocalFacts().blocking
    for kind, msg, detail, code in (("auth", "denied", "", "auth_refused"), ("host_key", "x", "", "host_key_changed"),
                                    ("unreachable", "refused", "", "unreachable"), ("timeout", "t", "", "timeout"),
                                    ("refused", "version: agent config: /etc/a.toml: no such agent config file", "",
                                     "agent_config"),
                                    ("agent", "version: not JSON", "sh: 1: version: not found", "forced_command"),
                                    ("agent", "version: the agent failed: Boom", "", "agent_failed")):
        got = call_findings(WHERE, kind, msg, detail)
        assert [f.code for f in got] == [code] and all(f.fix for f in got), (kind, got)
    assert "version: not found" in call_findings(WHERE, "agent", "x", "sh: 1: version: not found")[0].problem
    fine = {"version": __version__, "ranks": ["VLLM::Worker_TP1"], "ptrace_allowed": True, "pyspy": "/x/py-spy"}
    assert answer_findings(fine, __version__) == []
    bad = answer_findings({"version": "0.0", "ranks": [], "ptrace_allowed": False, "pyspy": "", "ignored": 2,
                           "audit_problem": "audit log /x: Not a directory"}, __version__)
    assert {f.code: f.severity for f in bad} == {"audit_log": "problem", "ptrace": "problem",
                                                 "version_mismatch": "problem", "pyspy_missing": "problem",
                                                 "ignored": "warning", "no_engine_ranks": "warning"}


def test_exit_status_tells_no_ranks_apart() -> None:
    ok = {"fine": True, "engine_ranks_found": True}
    assert exit_status([ok]) == EXIT_FINE
    assert exit_status([ok, {"fine": True, "engine_ranks_found": False}]) == EXIT_NO_RANKS
    assert exit_status([{"fine": False, "engine_ranks_found": False}, ok]) == EXIT_PROBLEM


def test_local_facts_read_the_key_mode_and_known_hosts(tmp_path: Path) -> None:
    keygen(tmp_path / "id")
    host = enrol.parse_public_key(keygen(tmp_path / "host"))
    kh = tmp_path / "known_hosts"
    node = NodeSection(name="w", host="10.0.0.2", port=2222, identity_file=str(tmp_path / "id"),
                       known_hosts_file=str(kh))
    assert local_facts(node).known_hosts == "missing"
    kh.write_text(enrol.known_hosts_line("10.0.0.2", 22, host))  # the port-22 form for a node on 2222
    facts = local_facts(node)
    assert facts.known_hosts == "unknown" and "[10.0.0.2]:2222" in facts.detail
    kh.write_text(enrol.known_hosts_line("10.0.0.2", 2222, host))
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], capture_output=True, timeout=30, check=True)  # hashed
    assert local_facts(node) == LocalFacts()
    os.chmod(tmp_path / "id", 0o640)
    assert local_facts(node).key == "mode"
    assert local_facts(dataclasses.replace(node, identity_file=str(tmp_path / "none"))).key == "missing"


def test_nodes_init_writes_the_set_up_and_keeps_the_config_text(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    host = keygen(tmp_path / "host_key")
    cfg = tmp_path / "etc" / "config.toml"
    cfg.parent.mkdir()
    before = '# my notes stay\n[engine]\nurl = "http://127.0.0.1:8123"   # mine\n'
    cfg.write_text(before)
    argv = ["nodes", "init", "worker1", "10.0.0.2", "--port", "2222", "--config", str(cfg),
            "--host-key-file", str(tmp_path / "host_key.pub"), "--agent-python", "/opt/wd/bin/python"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    home = cfg.parent / "nodes" / "worker1"
    line = (home / "authorized_keys").read_text()
    assert line.strip() in out and 'command="/opt/wd/bin/python -m watchdog.nodes.agent' in line
    assert (home / "id_ed25519").stat().st_mode & 0o777 == 0o600 and home.stat().st_mode & 0o777 == 0o700
    assert (home / "known_hosts").read_text() == f"[10.0.0.2]:2222 {' '.join(host.split()[:2])}\n"
    assert cfg.read_text().startswith(before)
    node = load(str(cfg)).nodes[0]
    assert (node.name, node.host, node.port, node.user) == ("worker1", "10.0.0.2", 2222, "root")
    assert node.identity_file == str(home / "id_ed25519") and node.known_hosts_file == str(home / "known_hosts")
    load_agent_config(str(home / "agent.toml"))
    key = (home / "id_ed25519").read_bytes()
    # again: the key kept, the entry not doubled
    assert main(argv) == 0 and (home / "id_ed25519").read_bytes() == key and len(load(str(cfg)).nodes) == 1
    # another host key for the same node: refused, known_hosts untouched
    keygen(tmp_path / "other")
    kh = (home / "known_hosts").read_text()
    assert main([*argv[:-4], "--host-key-file", str(tmp_path / "other.pub")]) == 1
    assert (home / "known_hosts").read_text() == kh and "--force" in capsys.readouterr().err


def test_nodes_init_changes_nothing_on_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[engine]\nnope = 1\n")
    (tmp_path / "junk.pub").write_text("not a key\n")
    assert main(["nodes", "init", "w", "h", "--config", str(cfg), "--host-key-file", str(tmp_path / "junk.pub")]) == 1
    assert "not a public key" in capsys.readouterr().err and not (tmp_path / "nodes").exists()
    keygen(tmp_path / "hk")
    assert main(["nodes", "init", "w", "h", "--config", str(cfg), "--host-key-file", str(tmp_path / "hk.pub")]) == 1
    assert "does not load" in capsys.readouterr().err and cfg.read_text() == "[engine]\nnope = 1\n"
    assert main(["nodes", "init", "local", "h", "--config", str(cfg), "--host-key-file", str(tmp_path / "hk.pub")]) \
        == 64


def test_the_agent_says_in_its_answer_that_its_audit_log_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    conf = tmp_path / "agent.toml"
    conf.write_text(f'audit_log = "{tmp_path}/afile/agent.log"\n')
    env = {**os.environ, "SSH_ORIGINAL_COMMAND": "version"}
    r = subprocess.run([sys.executable, "-m", "watchdog.nodes.agent", "--config", str(conf)], input="{}",
                       capture_output=True, text=True, env=env, timeout=60, check=False)
    answer = json.loads(r.stdout.strip().splitlines()[-1])
    assert answer["ok"] is True and f"{tmp_path}/afile/agent.log" in answer["audit_problem"], answer
    assert [f.code for f in answer_findings(answer, answer["version"])][:1] == ["audit_log"]


def test_the_docs_vllm_commands_are_the_two_node_harness_ones() -> None:
    """The page's vLLM commands (not run by its setup test) carry the flags and variables the real two-node test
    starts vLLM with (tests/harness/two_node.py), each node its own rank and address."""
    serve = [b for b in re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), re.M | re.S) if "vllm serve" in b]
    head = next(b for b in serve if "--node-rank 0" in b)
    worker = next(b for b in serve if "--node-rank 1" in b)
    harness = (Path(__file__).resolve().parents[1] / "harness" / "two_node.py").read_text()
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--headless", "--tensor-parallel-size",
                 "--distributed-executor-backend", "GLOO_SOCKET_IFNAME", "VLLM_HOST_IP"):
        assert flag in harness and flag in worker, flag
    for b, addr in ((head, "10.0.0.1"), (worker, "10.0.0.2")):
        assert f"VLLM_HOST_IP={addr}" in b and "--master-addr 10.0.0.1" in b and "--nnodes 2" in b
        assert "--master-port 29501" in b and "GLOO_SOCKET_IFNAME=" in b
    assert "--headless" not in head and "--port 8000" in head
