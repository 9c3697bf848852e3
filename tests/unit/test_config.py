"""``watchdog.config.load``: loading, validation (every error names the file and key), immutability, secrets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.facts import says
from watchdog.config.load import Config, ConfigError, Secret, load
from watchdog.core.types import HttpLimits
from watchdog.judge.track import Thresholds

SECRET = "sk-very-secret-0123456789"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "watchdog.toml"
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load(path)
    message = str(err.value)
    assert message.startswith(f"{path}: "), f"the message must name the file: {message!r}"
    return message


# -- the file ----------------------------------------------------------------------------------------


def test_no_file_means_defaults() -> None:
    cfg = load(None)
    assert cfg == Config()
    assert cfg.source == "<defaults>"
    assert cfg.engine.url == "http://127.0.0.1:8000"
    assert cfg.thresholds() == Thresholds(suspect_after=5.0, stall_window=40.0, probe_interval=10.0, probe_retry=5.0)
    assert cfg.scrape.limits() == HttpLimits()


def test_empty_file_means_defaults_with_its_name(tmp_path: Path) -> None:
    path = write(tmp_path, "# nothing set\n")
    cfg = load(str(path))
    assert dataclasses.replace(cfg, source="<defaults>") == Config()
    assert cfg.source == str(path)


def test_a_full_file_is_read_with_its_types(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, """
[engine]
url = "http://10.0.0.5:8001/metrics"
name = "llama-70b"
[scrape]
interval = 2          # a whole number where a number is expected is fine
max_bytes = 1048576
[judge]
suspect_after = 20.5
stall_window = 60
[probe]
enabled = false
[exporter]
port = 0
[state]
dir = "/tmp/wd"
trace_max_bytes = 0
"""))
    assert cfg.engine.url == "http://10.0.0.5:8001/metrics"
    assert cfg.scrape.interval == 2.0 and isinstance(cfg.scrape.interval, float)
    assert cfg.scrape.limits().max_bytes == 1048576
    assert cfg.thresholds() == Thresholds(suspect_after=20.5, stall_window=60.0, probe_interval=0.0, probe_retry=5.0)
    assert (cfg.exporter.port, cfg.state.dir, cfg.state.trace_max_bytes) == (0, "/tmp/wd", 0)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="no such config file") as err:
        load(path)
    assert str(path) in str(err.value)


def test_a_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as err:
        load(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_invalid_toml(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[judge]\nsuspect_after = = 3\n")
    assert "not valid TOML" in message and "line 2" in message


def test_unknown_section(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[engin]\nurl = \"http://127.0.0.1:8000\"\n")
    assert "unknown key 'engin'" in message
    assert says(message, "engine", "scrape", "judge", "probe", "capture", "incidents", "exporter", "state"), message


def test_top_level_key_is_an_unknown_section(tmp_path: Path) -> None:
    assert "unknown key 'url'" in load_error(tmp_path, 'url = "http://127.0.0.1:8000"\n')


def test_section_must_be_a_table(tmp_path: Path) -> None:
    message = load_error(tmp_path, 'engine = "http://127.0.0.1:8000"\n')
    assert "engine must be a table ([engine])" in message and "got a string" in message


def test_unknown_key_names_section_and_key(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[scrape]\nintervall = 1.0\n")
    assert "unknown key scrape.intervall" in message
    assert "interval" in message.split("known:")[1], "the message should list the keys that exist"


@pytest.mark.parametrize(("toml", "key", "problem"), [
    ('[judge]\nsuspect_after = "15"', "judge.suspect_after", "expected a number, got a string '15'"),
    ("[scrape]\ninterval = true", "scrape.interval", "expected a number, got a boolean True"),
    ("[exporter]\nport = true", "exporter.port", "expected a whole number, got a boolean True"),
    ("[exporter]\nport = 9830.0", "exporter.port", "expected a whole number, got a number 9830.0"),
    ('[exporter]\nport = "9830"', "exporter.port", "expected a whole number, got a string '9830'"),
    ("[state]\ntrace_max_bytes = 1.5e9", "state.trace_max_bytes", "expected a whole number, got a number"),
    ("[probe]\nenabled = 1", "probe.enabled", "expected true or false, got a whole number 1"),
    ('[probe]\nenabled = "yes"', "probe.enabled", "expected true or false, got a string 'yes'"),
    ("[engine]\nurl = 8000", "engine.url", "expected a string, got a whole number 8000"),
    ("[engine]\nname = [\"a\"]", "engine.name", "expected a string, got a list"),
    ("[judge]\nstall_window = {x = 1}", "judge.stall_window", "expected a number, got a table"),
])
def test_wrong_type_names_the_key(tmp_path: Path, toml: str, key: str, problem: str) -> None:
    message = load_error(tmp_path, toml + "\n")
    assert f": {key}: {problem}" in message, message


def test_suspect_after_must_not_exceed_stall_window(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[judge]\nsuspect_after = 50\nstall_window = 40\n")
    assert says(message, "judge.suspect_after", "50", "exceed", "judge.stall_window", "40"), message


def test_suspect_after_equal_to_stall_window_is_allowed(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, "[judge]\nsuspect_after = 40\nstall_window = 40\n"))
    assert cfg.judge.suspect_after == cfg.judge.stall_window == 40.0


@pytest.mark.parametrize(("toml", "key"), [
    ("[scrape]\ninterval = 0", "scrape.interval"),
    ("[scrape]\ndeadline = -1", "scrape.deadline"),
    ("[scrape]\nmax_bytes = 0", "scrape.max_bytes"),
    ("[judge]\nsuspect_after = 0", "judge.suspect_after"),
    ("[judge]\nstall_window = -1", "judge.stall_window"),
    ("[probe]\ntimeout = -5", "probe.timeout"),
])
def test_values_that_must_be_positive(tmp_path: Path, toml: str, key: str) -> None:
    message = load_error(tmp_path, toml + "\n")
    assert says(message, key, "greater than 0"), message


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8000", "127.0.0.1:8000", "http://", ""])
def test_bad_url(tmp_path: Path, url: str) -> None:
    message = load_error(tmp_path, f'[engine]\nurl = "{url}"\n')
    assert says(message, "engine.url", "http(s)", "URL") and repr(url) in message, message


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_port_out_of_range(tmp_path: Path, port: int) -> None:
    message = load_error(tmp_path, f"[exporter]\nport = {port}\n")
    assert says(message, "exporter.port", "0..65535", port), message


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_port_in_range(tmp_path: Path, port: int) -> None:
    assert load(write(tmp_path, f"[exporter]\nport = {port}\n")).exporter.port == port


@pytest.mark.parametrize("key", ["trace_max_bytes", "events_max_bytes"])
def test_negative_state_file_size(tmp_path: Path, key: str) -> None:
    message = load_error(tmp_path, f"[state]\n{key} = -1\n")
    assert says(message, f"state.{key}", "0 or more"), message


def test_the_event_log_rolls_over_by_default_and_can_be_told_not_to(tmp_path: Path) -> None:
    assert load(write(tmp_path, "")).state.events_max_bytes == 16 * 1024 * 1024
    assert load(write(tmp_path, "[state]\nevents_max_bytes = 0\n")).state.events_max_bytes == 0


# -- immutability ------------------------------------------------------------------------------------


def test_config_is_immutable(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, "[judge]\nsuspect_after = 10\n"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.judge.suspect_after = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.judge = cfg.judge  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        cfg.extra = 1  # type: ignore[attr-defined]
    assert cfg.judge.suspect_after == 10.0


# -- secrets -----------------------------------------------------------------------------------------


def _assert_hidden(secret: Secret) -> None:
    for shown in (repr(secret), str(secret), f"{secret}", f"{secret!r}", repr([secret]), repr({"k": secret})):
        assert SECRET not in shown, shown
    assert repr(secret) == "Secret(***)"


def test_api_key_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_TEST_KEY", SECRET)
    cfg = load(write(tmp_path, '[probe]\napi_key_env = "WATCHDOG_TEST_KEY"\n'))
    key = cfg.api_key()
    assert key and key.reveal() == SECRET
    _assert_hidden(key)
    assert SECRET not in repr(cfg)


def test_api_key_env_unset_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    key = Config().api_key()
    assert not key and key.reveal() == "" and repr(key) == "Secret()"


def test_api_key_from_default_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    assert Config().api_key().reveal() == SECRET


def test_api_key_from_file_takes_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-the-environment")
    key_file = tmp_path / "key"
    key_file.write_text(f"  {SECRET}\n")
    cfg = load(write(tmp_path, f'[probe]\napi_key_file = "{key_file}"\n'))
    key = cfg.api_key()
    assert key.reveal() == SECRET
    _assert_hidden(key)


def test_api_key_file_missing(tmp_path: Path) -> None:
    missing = tmp_path / "no-key"
    cfg = load(write(tmp_path, f'[probe]\napi_key_file = "{missing}"\n'))
    with pytest.raises(ConfigError) as err:
        cfg.api_key()
    message = str(err.value)
    assert "probe.api_key_file" in message and str(missing) in message and "No such file" in message


# -- overrides ---------------------------------------------------------------------------------------


def test_with_overrides_replaces_and_keeps_the_original(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, "[judge]\nsuspect_after = 10\n"))
    new = cfg.with_overrides(engine={"url": "http://127.0.0.1:9000"}, judge={"stall_window": 90, "suspect_after": None})
    assert new.engine.url == "http://127.0.0.1:9000"
    assert (new.judge.suspect_after, new.judge.stall_window) == (10.0, 90.0), "None must leave a key as it was"
    assert new.source == cfg.source
    assert cfg.engine.url == "http://127.0.0.1:8000" and cfg.judge.stall_window == 40.0


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"judge": {"suspect_after": 100.0}}, "judge.suspect_after (100) must not exceed judge.stall_window (40)"),
    ({"exporter": {"port": 99999}}, "exporter.port must be 0..65535"),
    ({"exporter": {"port": "8080"}}, "exporter.port: expected a whole number, got a string '8080'"),
    ({"engine": {"url": "ftp://x"}}, "engine.url: not an http(s) URL"),
    ({"scrape": {"interval": -1.0}}, "scrape.interval must be greater than 0"),
    ({"probe": {"enabled": "no"}}, "probe.enabled: expected true or false"),
    ({"judge": {"stall_windw": 1.0}}, "unknown key judge.stall_windw"),
])
def test_with_overrides_validates(overrides: dict[str, dict[str, object]], problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config().with_overrides(**overrides)
    assert problem in str(err.value)
    assert str(err.value).startswith("<defaults>: ")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_rejected(tmp_path: Path, value: str) -> None:
    message = load_error(tmp_path, f"[scrape]\ninterval = {value}\n")
    assert says(message, "scrape.interval", "finite"), message


# -- [restart] and [alerts] --------------------------------------------------------------------------


def test_restart_steps_and_alert_sinks_are_read_in_order(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, """
[restart]
pre_start = ["/bin/sync"]
[[restart.steps]]
kind = "systemd"
action = "stop"
units = ["worker.service", "head.service"]
[[restart.steps]]
kind = "command"
argv = ["/opt/start.sh", "--fast"]
timeout = 30
[[alerts.sinks]]
kind = "slack"
url_env = "SLACK_URL"
"""))
    stop, run = cfg.restart.steps
    assert (stop.kind, stop.verb, stop.units) == ("systemd", "stop", ("worker.service", "head.service"))
    assert (run.verb, run.argv, run.timeout, run.node) == ("run", ("/opt/start.sh", "--fast"), 30.0, "local")
    assert cfg.restart.pre_start == ("/bin/sync",) and cfg.alerts.sinks[0].url_env == "SLACK_URL"
    assert cfg.with_overrides(restart={"dry_run": True}).restart.steps == cfg.restart.steps


@pytest.mark.parametrize(("toml", "problem"), [
    ('[[restart.steps]]\nkind = "ansible"', "restart.steps[0].kind: 'ansible' is not one of"),
    ('[[restart.steps]]\nkind = "command"', "restart.steps[0].argv: a command step needs argv"),
    ('[[restart.steps]]\nkind = "systemd"\naction = "run"\nunits = ["a"]', "restart.steps[0].action"),
    ('[[restart.steps]]\nkind = "systemd"\nunits = ["a"]\nargv = ["b"]', "restart.steps[0].argv: a systemd step takes"),
    ('[[restart.steps]]\nkind = "command"\nargv = "ls -l"', "restart.steps[0].argv: expected a list of strings"),
    ('[[restart.steps]]\nkind = "command"\nargv = ["a"]\nnode = "spark-2"', "restart.steps[0].node"),
    ('[[restart.steps]]\nkind = "command"\nargv = ["a"]\nshell = true', "unknown key restart.steps[0].shell"),
    ("[restart]\nsteps = 3", "restart.steps must be a list of tables"),
    ("[restart]\nboot_timeout = 0", "restart.boot_timeout must be greater than 0"),
    ("[restart]\nbackoff_initial = 60\nbackoff_max = 10", "backoff_max"),
    ('[[alerts.sinks]]\nkind = "pager"\nurl = "http://x"', "alerts.sinks[0].kind"),
    ('[[alerts.sinks]]\nurl = "http://x"\nurl_env = "U"', "alerts.sinks[0]: give exactly one of url"),
    ('[[alerts.sinks]]\nkind = "slack"\nurl = "http://x"\nsecret_env = "S"', "only webhook sinks sign"),
    ('[[alerts.sinks]]\nurl = "http://a"\n[[alerts.sinks]]\nurl = "http://b"', "alerts.sinks[1].name"),
])
def test_bad_restart_and_alert_settings_name_the_key(tmp_path: Path, toml: str, problem: str) -> None:
    assert problem in load_error(tmp_path, toml)


def test_secret_from_file_or_environment_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load(None)
    monkeypatch.setenv("WD_SECRET", SECRET)
    assert cfg.secret("alerts.sinks[0].secret", "WD_SECRET", "").reveal() == SECRET
    (tmp_path / "s").write_text(SECRET + "\n")
    assert cfg.secret("k", "WD_SECRET", str(tmp_path / "s")).reveal() == SECRET
    assert not cfg.secret("k", "", "")
    monkeypatch.delenv("WD_SECRET")
    with pytest.raises(ConfigError, match="k_env: the environment variable WD_SECRET is not set"):
        cfg.secret("k", "WD_SECRET", "")
    with pytest.raises(ConfigError, match="k_file: cannot read"):
        cfg.secret("k", "", str(tmp_path / "absent"))
