"""`watchdog config check` and which config file every verb reads: real `watchdog` processes, real files."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from watchdog.cli.config import CONFIG_ENV, config_path, load_config
from watchdog.config.act import AlertsSection, SinkSection
from watchdog.config.load import ConfigError, ProbeSection

NODE = """
[[nodes]]
name = "worker1"
host = "10.0.0.2"
identity_file = "/etc/engine-watchdog/nodes/worker1/id_ed25519"
known_hosts_file = "/etc/engine-watchdog/nodes/worker1/known_hosts"
"""
STEPS = """
[[restart.steps]]
kind = "systemd"
action = "stop"
units = ["vllm.service"]
[[restart.steps]]
kind = "command"
action = "restart"
node = "worker1"
argv = ["/usr/bin/systemctl", "restart", "vllm-worker.service"]
[[restart.steps]]
kind = "systemd"
action = "start"
units = ["vllm.service"]
"""


def watchdog_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", *args], capture_output=True, text=True, timeout=60,
                          start_new_session=True, check=False, env=env)


def config(tmp_path: Path, text: str, name: str = "config.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_valid_config_is_one_line_with_what_it_holds_and_exit_0(tmp_path: Path) -> None:
    path = config(tmp_path, NODE + STEPS)
    r = watchdog_cli("config", "check", "--config", path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"config OK: {path} (1 engine, 2 nodes, 3 restart steps)\n"
    r = watchdog_cli("config", "check", "--config", config(tmp_path, "", "empty.toml"))
    assert r.returncode == 0 and r.stdout.endswith("(1 engine, 1 node, 0 restart steps)\n"), r.stderr


BAD = [
    ("[judge]\nstall_windw = 3\n", "unknown key judge.stall_windw (known: stall_window, suspect_after)"),
    ('[judge]\nstall_window = "40s"\n', "judge.stall_window: expected a number, got a string '40s'"),
    ("[judge\n", "not valid TOML"),
    (STEPS, "restart.steps[1].node: unknown node 'worker1'"),
    ('[[alerts.sinks]]\nkind = "slack"\nurl_env = "NO_SUCH_VARIABLE_SET_HERE"\n',
     "alerts.sinks[0].url_env: the environment variable NO_SUCH_VARIABLE_SET_HERE is not set"),
]


@pytest.mark.parametrize(("text", "said"), BAD)
def test_a_bad_config_is_exit_64_with_the_key_named_as_the_daemon_refuses_it(
        tmp_path: Path, text: str, said: str, daemon_proc: list[subprocess.Popen[str]]) -> None:
    path = config(tmp_path, text)
    r = watchdog_cli("config", "check", "--config", path)
    assert r.returncode == 64 and r.stdout == ""
    assert r.stderr.startswith(f"watchdog: config error: {path}: ") and r.stderr.count("\n") == 1
    assert said in r.stderr
    # the service refuses the same file with the same words and the same exit: the check says what it would do
    # (the service itself, not --once: that pass builds no alert sinks)
    daemon = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--config", path, "--state-dir",
                               str(tmp_path / "state"), "--metrics-port", "0"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    daemon_proc.append(daemon)
    _, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 64 and said in err


def test_json_says_valid_or_the_error(tmp_path: Path) -> None:
    good = config(tmp_path, NODE + STEPS)
    r = watchdog_cli("config", "check", "--config", good, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["valid"] is True and out["error"] is None
    assert (out["config"], out["engines"], out["nodes"], out["restart_steps"]) == (good, 1, ["local", "worker1"], 3)
    bad = config(tmp_path, BAD[0][0], "bad.toml")
    r = watchdog_cli("config", "check", "--config", bad, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 64 and out["valid"] is False and "judge.stall_windw" in out["error"]


def _secret_files() -> list[tuple[str, str]]:
    """(the config text, its key) for every ``*_file`` setting that names a secret: a new one is checked too."""
    base = {"probe": ProbeSection, "alerts": AlertsSection, "alerts.sinks[0]": SinkSection}
    out = []
    for where, cls in base.items():
        for f in dataclasses.fields(cls):
            if not f.name.endswith("_file"):
                continue
            missing = '"/nonexistent/secret"'
            if where == "alerts.sinks[0]":
                url = "" if f.name == "url_file" else 'url = "http://127.0.0.1:9/"\n'
                out.append((f'[[alerts.sinks]]\nkind = "webhook"\n{url}{f.name} = {missing}\n', f"{where}.{f.name}"))
            else:
                out.append((f"[{where}]\n{f.name} = {missing}\n", f"{where}.{f.name}"))
    return out


@pytest.mark.parametrize(("text", "key"), _secret_files())
def test_every_secret_file_is_read_by_the_check(tmp_path: Path, text: str, key: str) -> None:
    r = watchdog_cli("config", "check", "--config", config(tmp_path, text))
    assert r.returncode == 64 and key in r.stderr and "cannot read /nonexistent/secret" in r.stderr, r.stderr


def test_a_secret_read_is_never_printed(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cr3t-token-value\n")
    text = f'[[alerts.sinks]]\nkind = "webhook"\nurl = "http://127.0.0.1:9/"\nsecret_file = "{tmp_path}/token"\n'
    r = watchdog_cli("config", "check", "--config", config(tmp_path, text), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["secrets_read"] == 1
    assert "s3cr3t" not in r.stdout + r.stderr


def test_the_file_comes_from_the_flag_then_the_variable_then_the_default(tmp_path: Path) -> None:
    assert config_path("a.toml", {CONFIG_ENV: "b.toml"}).path == "a.toml"
    assert config_path(None, {CONFIG_ENV: "b.toml"}) == config_path("b.toml", {})
    assert config_path(None, {CONFIG_ENV: ""}).default and config_path(None, {}).path == \
        "/etc/engine-watchdog/config.toml"
    named = config(tmp_path, "[engine]\nname = \"from-the-variable\"\n")
    r = watchdog_cli("config", "check", env=dict(os.environ, **{CONFIG_ENV: named}))
    assert r.returncode == 0 and r.stdout.startswith(f"config OK: {named} "), r.stderr
    r = watchdog_cli("config", "check", env=dict(os.environ, **{CONFIG_ENV: str(tmp_path / "absent.toml")}))
    assert r.returncode == 64 and "absent.toml: no such config file" in r.stderr


def test_a_missing_default_file_is_the_defaults_said_on_stderr_or_an_error_where_the_file_is_needed(
        tmp_path: Path) -> None:
    absent = str(tmp_path / "etc" / "config.toml")
    note = tmp_path / "note.txt"
    with note.open("w") as stream:
        cfg = load_config(None, environ={}, default=absent, note=stream)
    assert cfg.source == "<defaults>" and cfg.engine.url == "http://127.0.0.1:8000"
    assert f"{absent} does not exist: the built-in defaults are used" in note.read_text()
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(None, needs_file=True, environ={}, default=absent)
    # a file named by the flag or the variable must be there, default or not
    for given, environ in ((absent, {}), (None, {CONFIG_ENV: absent})):
        with pytest.raises(ConfigError, match="no such config file"):
            load_config(given, environ=environ, default=absent)
    present = config(tmp_path, "[engine]\nname = \"here\"\n")
    assert load_config(None, environ={}, default=present).engine.name == "here"


def test_nodes_without_a_config_file_is_an_error_never_fine(tmp_path: Path) -> None:
    r = watchdog_cli("nodes", "--config", str(tmp_path / "absent.toml"))
    assert r.returncode == 64 and "no such config file" in r.stderr and "no other nodes" not in r.stdout
    r = watchdog_cli("nodes", "--config", config(tmp_path, "[engine]\nname = \"one-node\"\n"))
    assert r.returncode == 0 and f"no other nodes configured in {tmp_path}" in r.stdout, r.stderr


def test_the_writers_never_write_over_what_is_not_a_regular_file(tmp_path: Path) -> None:
    env = dict(os.environ, **{CONFIG_ENV: os.devnull})
    r = watchdog_cli("init", "--url", "http://127.0.0.1:9", "--force", env=env)
    assert r.returncode == 1 and "is not a regular file: nothing written" in r.stderr
    assert Path(os.devnull).is_char_device()
    r = watchdog_cli("nodes", "init", "w1", "10.0.0.2", "--host-key-fingerprint", "SHA256:x", env=env)
    assert r.returncode == 64 and "is not a regular file: nothing written" in r.stderr
    assert not Path("/dev/nodes").exists()


def test_config_without_a_subcommand_is_a_usage_error() -> None:
    r = watchdog_cli("config")
    assert r.returncode == 64 and "check" in r.stderr


def test_config_get_prints_one_value_with_the_defaults_filled_in(tmp_path: Path) -> None:
    path = config(tmp_path, '[engine]\nurl = "http://127.0.0.1:9000"\n' + NODE + STEPS)
    got = {key: watchdog_cli("config", "get", key, "--config", path) for key in (
        "engine.url", "state.dir", "capture.journal_unit", "nodes.0.host", "restart.steps.1.argv")}
    assert {k: (r.returncode, r.stdout) for k, r in got.items()} == {
        "engine.url": (0, "http://127.0.0.1:9000\n"), "state.dir": (0, "/var/lib/engine-watchdog\n"),
        "capture.journal_unit": (0, "\n"), "nodes.0.host": (0, "10.0.0.2\n"),
        "restart.steps.1.argv": (0, '["/usr/bin/systemctl", "restart", "vllm-worker.service"]\n')}
    # the file the verbs read (the variable here), not only --config
    env = {**os.environ, CONFIG_ENV: path}
    assert watchdog_cli("config", "get", "engine.url", env=env).stdout == "http://127.0.0.1:9000\n"


@pytest.mark.parametrize("key", ["engine.uri", "nodes.3.host", "bogus", "engine.url.x"])
def test_config_get_of_an_unknown_key_is_exit_64_naming_it(tmp_path: Path, key: str) -> None:
    r = watchdog_cli("config", "get", key, "--config", config(tmp_path, NODE))
    assert r.returncode == 64 and r.stdout == "" and "no config key" in r.stderr, r
