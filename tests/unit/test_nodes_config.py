"""[[nodes]] in the config, steps on nodes, the agent's own config, the pure protocol."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_layout import IO, reach
from watchdog.config.load import ConfigError, load
from watchdog.nodes.agent_config import load_agent_config, normal
from watchdog.nodes.protocol import ProtocolError, parse_answer, parse_verb

NODE = '[[nodes]]\nname = "worker1"\nhost = "10.0.0.2"\nidentity_file = "/k"\nknown_hosts_file = "/kh"\n'


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_steps_run_on_named_nodes_and_local_stays_valid(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, NODE + '[[restart.steps]]\nkind = "command"\nargv = ["a"]\nnode = "worker1"\n'
                     '[[restart.steps]]\nkind = "command"\nargv = ["b"]\nnode = "local"\n'))
    assert [s.node for s in cfg.restart.steps] == ["worker1", "local"]
    assert cfg.nodes[0].host == "10.0.0.2" and cfg.nodes[0].user == "root"


@pytest.mark.parametrize(("text", "named"), [
    ('[[restart.steps]]\nkind = "command"\nargv = ["a"]\nnode = "worker2"\n', "restart.steps[0].node: unknown node"),
    (NODE + 'colour = "red"\n', "unknown key nodes[0].colour"),
    (NODE.replace('identity_file = "/k"\n', ""), "nodes[0].identity_file: required"),
    (NODE.replace('known_hosts_file = "/kh"\n', ""), "nodes[0].known_hosts_file: required"),
    (NODE + NODE, "nodes[1].name: 'worker1' names two nodes"),
    (NODE.replace("worker1", "local"), "nodes[0].name"),
    (NODE + "port = 0\n", "nodes[0].port"),
])
def test_bad_node_config_names_the_key(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load(write(tmp_path, text))


def test_agent_config_allows_only_its_steps(tmp_path: Path) -> None:
    p = tmp_path / "agent.toml"
    p.write_text('pre_start = ["sync"]\n[[steps]]\nkind = "systemd"\naction = "stop"\nunits = ["vllm-worker"]\n'
                 '[[steps]]\nkind = "docker"\naction = "restart"\ncontainers = ["w"]\n')
    allowed = load_agent_config(str(p)).allowed()
    assert ("systemctl", "--no-ask-password", "stop", "--", "vllm-worker") in allowed
    assert ("sync",) in allowed
    assert normal(["docker", "restart", "--time", "7", "w"]) in allowed  # the head lowers --time to fit
    assert ("systemctl", "--no-ask-password", "start", "--", "vllm-worker") not in allowed
    p.write_text('steps_extra = 1\n')
    with pytest.raises(ConfigError, match=r"unknown key agent\.steps_extra"):
        load_agent_config(str(p))


@pytest.mark.parametrize("command", [None, "", "version; id", "sh -c id", "versions", "run --all"])
def test_only_bare_verbs(command: str | None) -> None:
    with pytest.raises(ProtocolError):
        parse_verb(command)


def test_answers() -> None:
    assert parse_verb(" list ") == "list"
    assert parse_answer(b'{"ok": true, "x": 1}')["x"] == 1
    with pytest.raises(ProtocolError, match="nope"):
        parse_answer(b'{"ok": false, "error": "nope"}')
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_answer(b"\x00garbage")


@pytest.mark.parametrize("name", ["watchdog.nodes.protocol", "watchdog.nodes.liveness"])
def test_pure_node_modules_reach_no_io(name: str) -> None:
    bad = {dep for dep in reach(name) if dep.split(".")[0] in IO or dep in IO}
    assert not bad, f"{name} reaches I/O: {bad}"


@pytest.mark.parametrize(("text", "named"), [
    ("[capture]\nrounds = 6\n", "capture.rounds must be 1 to 5"),
    ("[capture]\ntimeout = 61\n", "capture.timeout must be 0.5 to 60"),
    ("[capture]\ntimeout = 0.4\n", "capture.timeout must be 0.5 to 60"),
    ("[capture]\ngap = 31\n", "capture.gap must be 0 to 30"),
    ("liveness_interval = 0.1\n", "nodes[0].liveness_interval must be 0.2 to 60"),
    ("liveness_interval = 61\nliveness_stale = 200\n", "nodes[0].liveness_interval must be 0.2 to 60"),
])
def test_the_head_refuses_what_every_agent_would(tmp_path: Path, text: str, named: str) -> None:
    """With [[nodes]], a [capture] or liveness value the agents refuse is refused at load, the key named (before: the
    head loaded it, and every node refused every stacks call, or its liveness stream, for good)."""
    config = NODE + text if not text.startswith("[") else text + NODE
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        load(write(tmp_path, config))
    if text.startswith("[capture]"):  # no nodes: nothing of it goes to an agent
        load(write(tmp_path, text))


@pytest.mark.parametrize("edge", ["low", "high"])
def test_what_the_head_accepts_every_agent_takes(tmp_path: Path, edge: str) -> None:
    from watchdog.config.nodes import CAPTURE_GAP, CAPTURE_ROUNDS, CAPTURE_TIMEOUT, LIVENESS_INTERVAL
    from watchdog.nodes.arguments import check_args
    i = 0 if edge == "low" else 1
    cfg = load(write(tmp_path, f"[capture]\nrounds = {CAPTURE_ROUNDS[i]}\ngap = {CAPTURE_GAP[i]}\n"
                               f"timeout = {CAPTURE_TIMEOUT[i]}\n" + NODE +
                     f"liveness_interval = {LIVENESS_INTERVAL[i]}\nliveness_stale = 100\n"))
    c = cfg.capture
    assert check_args("stacks", {"rounds": c.rounds, "gap": c.gap, "timeout": c.timeout})["rounds"] == c.rounds
    assert check_args("liveness", {"interval": cfg.nodes[0].liveness_interval})["interval"] == LIVENESS_INTERVAL[i]
    for key, far in (("rounds", CAPTURE_ROUNDS[1] + 1), ("gap", CAPTURE_GAP[1] + 1),
                     ("timeout", CAPTURE_TIMEOUT[1] + 1)):
        with pytest.raises(ProtocolError):
            check_args("stacks", {key: far})
