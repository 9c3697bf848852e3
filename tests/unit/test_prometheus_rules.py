"""deploy/prometheus, deploy/alertmanager and deploy/grafana, checked by the real promtool and amtool (Debian's
prometheus and prometheus-alertmanager, installed by scripts/setup) and against the real exporter's metric names.
The real Prometheus and Alertmanager scraping a real `watchdog run`: tests/engine/test_prometheus.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.prometheus import (
    ALERTMANAGER_EXAMPLE,
    AMTOOL_BIN,
    DASHBOARD,
    PROMETHEUS_EXAMPLE,
    PROMTOOL_BIN,
    RULES,
    RULES_TEST,
    copy_rules,
    seconds,
)
from watchdog.core.runbooks import Runbook, runbook_link
from watchdog.core.types import State, Verdict
from watchdog.evidence.gpu.readings import GpuSample
from watchdog.host.run import communicate, run
from watchdog.service.exporter import Exporter

PLACEHOLDER = "RUNBOOK_BASE"


class Tool(NamedTuple):
    ok: bool
    output: str  # stdout and stderr, whole


def promtool(*args: str) -> Tool:
    assert PROMTOOL_BIN.exists(), "promtool missing: scripts/setup installs Debian's prometheus"
    r = communicate([str(PROMTOOL_BIN), *args], timeout=60)
    return Tool(r.ok, (r.stdout + r.stderr).decode(errors="replace") + r.error)


def rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def unit_tests() -> list[dict[str, Any]]:
    return list(yaml.safe_load(RULES_TEST.read_text())["tests"])


def test_promtool_checks_the_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.ok, r.output
    assert f"SUCCESS: {sum(1 for _ in _all_rules())} rules found" in r.output


def _all_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_unit_tests_pass() -> None:
    r = promtool("test", "rules", str(RULES_TEST))
    assert r.ok, r.output
    assert "SUCCESS" in r.output


def test_the_unit_tests_fail_on_an_alert_that_fires_before_its_for(tmp_path: Path) -> None:
    """The unit tests can fail: with every `for:` halved, the checks one evaluation before it is over see alerts."""
    copy_rules(RULES, tmp_path / RULES.name, for_scale=0.5)
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    r = promtool("test", "rules", str(tmp_path / RULES_TEST.name))
    assert not r.ok and "FAILED" in r.output, r.output


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_keeps_it_quiet() -> None:
    fired: dict[str, set[str]] = {}
    quiet: dict[str, set[str]] = {}
    healthy: set[str] = set()
    for t in unit_tests():
        for check in t.get("alert_rule_test", []):
            name, at = check["alertname"], check["eval_time"]
            (fired if check["exp_alerts"] else quiet).setdefault(name, set()).add(at)
            if t["name"].startswith("a healthy watchdog") and not check["exp_alerts"]:
                healthy.add(name)
    alerts = rules()
    assert alerts, "no alerts in the rules file"
    for name, rule in alerts.items():
        assert name in fired, f"{name}: no promtool test fires it"
        assert name in healthy, f"{name}: not checked quiet on the healthy watchdog"
        # quiet one evaluation before its `for:` is over, in the same test that fires it
        test = next(t for t in unit_tests() if any(c["alertname"] == name and c["exp_alerts"]
                                                    for c in t.get("alert_rule_test", [])))
        firing_at = min(seconds(c["eval_time"]) for c in test["alert_rule_test"]
                        if c["alertname"] == name and c["exp_alerts"])
        quiet_at = [seconds(c["eval_time"]) for c in test["alert_rule_test"]
                    if c["alertname"] == name and not c["exp_alerts"]]
        assert any(firing_at - seconds(str(rule["for"])) < q < firing_at for q in quiet_at), \
            f"{name}: no check that it is quiet before its for: ({rule['for']}) is over"
    assert set(fired) <= set(alerts), f"tests of alerts that do not exist: {set(fired) - set(alerts)}"


def test_every_alert_says_what_and_links_its_runbook() -> None:
    for name, rule in rules().items():
        ann = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(ann), name
        assert ann["summary"].strip() and len(ann["description"]) > 40, name
        severity = rule.get("labels", {}).get("severity")  # or the incident's own, kept by the expression
        assert severity in ("critical", "warning") or (severity is None and re.search(
            r"max by \([^)]*\bseverity\b", rule["expr"]) and "watchdog_incident_info" in rule["expr"]), name
        assert "for" in rule, f"{name}: no for:"
        url = ann["runbook_url"]
        m = re.fullmatch(re.escape(PLACEHOLDER) + r"/([a-z-]+)\.md", url)
        assert m, f"{name}: runbook_url {url!r} is not {PLACEHOLDER}/<page>.md"
        page = Runbook(m[1])  # a page of the runbook vocabulary, or ValueError
        assert url == runbook_link(page, PLACEHOLDER)


def test_copy_rules_changes_only_the_for_durations_and_the_runbook_base(tmp_path: Path) -> None:
    fors = copy_rules(RULES, tmp_path / "r.yml", for_scale=1 / 20, runbook_base="https://wiki.test/runbooks/")
    before, after = RULES.read_text().splitlines(), (tmp_path / "r.yml").read_text().splitlines()
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert changed and all(b.strip().startswith(("for:", "runbook_url:")) for b, _ in changed), changed
    assert fors["EngineWatchdogEngineFrozen"] == 3 and fors["EngineWatchdogIncidentOpenLong"] == 90
    assert all(v >= 1 for v in fors.values())
    assert "https://wiki.test/runbooks/frozen.md" in (tmp_path / "r.yml").read_text()
    assert promtool("check", "rules", str(tmp_path / "r.yml")).ok


def test_the_example_prometheus_config_is_valid_with_the_rules(tmp_path: Path) -> None:
    text = PROMETHEUS_EXAMPLE.read_text()
    cfg = yaml.safe_load(text)
    assert [j["job_name"] for j in cfg["scrape_configs"]] == ["engine-watchdog"]  # the rules' job matchers
    assert all('job="engine-watchdog"' in r["expr"] for r in rules().values() if "job=" in r["expr"])
    copy_rules(RULES, tmp_path / "engine-watchdog.yml", 1.0, runbook_base="https://wiki.test")
    (tmp_path / "prometheus.yml").write_text(text.replace("/etc/prometheus/rules/engine-watchdog.yml",
                                                          str(tmp_path / "engine-watchdog.yml")))
    r = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert r.ok and "1 rule files found" in r.output, r.output


def test_the_example_alertmanager_config_is_valid() -> None:
    assert AMTOOL_BIN.exists(), "amtool comes with Debian's prometheus-alertmanager: run scripts/setup"
    r = run([str(AMTOOL_BIN), "check-config", str(ALERTMANAGER_EXAMPLE)], timeout=60)
    assert r.ok and "SUCCESS" in r.output, r.output
    cfg = yaml.safe_load(ALERTMANAGER_EXAMPLE.read_text())
    for rule in cfg["inhibit_rules"]:  # every name or pattern matches a shipped alert
        for m in rule["source_matchers"] + rule["target_matchers"]:
            if (found := re.fullmatch(r'alertname(=~?)"(.+)"', m)) is not None:
                pattern = found[2] if found[1] == "=~" else re.escape(found[2])
                assert any(re.fullmatch(pattern, name) for name in rules()), m


def test_the_example_alertmanager_config_pages_only_critical_alerts() -> None:
    def receiver(*labels: str) -> str:
        r = run([str(AMTOOL_BIN), "config", "routes", "test", f"--config.file={ALERTMANAGER_EXAMPLE}", *labels],
                timeout=60)
        assert r.ok, r.output
        return r.output.strip().splitlines()[-1]  # after a warning line about --alertmanager.url

    incident = ("engine=0", "stack=llama", "host=gpu-1", "incident_id=x")
    assert receiver("alertname=EngineWatchdogEngineFrozen", "severity=critical", *incident) == "engine-pager"
    assert receiver("alertname=EngineWatchdogEngineFrozen", "severity=warning", *incident) == "engine-chat"
    assert receiver("alertname=EngineWatchdogRestartBudgetLow", "severity=warning") == "engine-chat"
    assert receiver("alertname=EngineWatchdogGaveUp", "severity=critical") == "engine-pager"


def test_no_rule_is_named_like_kube_prometheus_watchdog() -> None:
    """kube-prometheus' always-firing dead-man alert is `Watchdog`: its dashboards match `Watchdog.*`."""
    assert rules() and all(name.startswith("EngineWatchdog") for name in rules())
    assert not [name for name in rules() if re.fullmatch("Watchdog.*", name)]


def test_the_rules_and_their_tests_follow_another_job_selector(tmp_path: Path) -> None:
    """The job selector is set as the install sets the runbook address (by substitution): the rules select the
    other job, and only it."""
    for src in (RULES, RULES_TEST):
        (tmp_path / src.name).write_text(src.read_text().replace('job="engine-watchdog"', 'job="gpu-watchdogs"')
                                         .replace('job=\\"engine-watchdog\\"', 'job=\\"gpu-watchdogs\\"')
                                         .replace("job: engine-watchdog", "job: gpu-watchdogs"))
    assert 'job="engine-watchdog"' not in (tmp_path / RULES.name).read_text()
    r = promtool("test", "rules", str(tmp_path / RULES_TEST.name))
    assert r.ok, r.output
    shutil.copy(RULES, tmp_path / RULES.name)  # the rules left on the old job: the same series no longer fire them
    r = promtool("test", "rules", str(tmp_path / RULES_TEST.name))
    assert not r.ok and "FAILED" in r.output


# -- the dashboard -------------------------------------------------------------------------------------------------

def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def targets(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in d["panels"] if p["type"] != "row" for t in p.get("targets", [])]


def test_the_dashboard_parses_and_every_panel_has_a_query_on_the_datasource_variable() -> None:
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in panels:
        assert p.get("targets"), f"{p['title']}: no query"
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", p["title"]
    for name in ("instance", "engine"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["query"]["query"].startswith("label_values(")
    titles = " ".join(p["title"].lower() for p in panels)
    for wanted in ("engine state", "incident", "restarts", "recover", "capture", "gpu power"):
        assert wanted in titles, f"no panel on {wanted}"


def exported_names() -> set[str]:
    """Every sample name the real exporter shows once each kind of thing has happened."""
    e = Exporter()
    e.set_verdicts([Verdict(engine="0", state=State.FROZEN, t=10.0, since=1.0, reason="test", last_progress=2.0,
                            stalled_for=8.0)], now=10.0)
    e.set_response({"incident": {"engine": "0", "id": "i"}, "recovery": {"phase": "restarting", "seconds": 3.0},
                    "paused": False, "budget_left": 2, "gave_up": False,
                    "blind": [{"what": "node:worker1", "seconds": 70.0}]})
    e.observe_gpu(GpuSample(t=1.0, index=0, util=50, power_w=300.0, sm_clock_mhz=1900))
    e.passes.sinks = lambda: [("am", "alertmanager", True)]
    e.observe_event("restart_started")
    e.observe_record({"event": "recovered", "downtime": 42.0})
    e.observe_record({"event": "evidence_captured", "capture_seconds": 3.5})
    e.pass_errors.labels("evidence").inc()
    e.write_errors.labels("events.jsonl").inc()
    e.scrape_errors.labels("refused").inc()
    e.transitions.labels("0", "working", "frozen").inc()
    e.probes.labels("ok").inc()
    text = generate_latest(e.registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_every_metric_the_rules_and_the_dashboard_read_is_exported() -> None:
    names = exported_names() | {"up", "ALERTS"}
    recorded = {r["record"] for r in _all_rules() if "record" in r}
    texts = [r["expr"] for r in _all_rules()] + [t["expr"] for _, t in targets(dashboard())]
    read = {n for text in texts for n in re.findall(r"\b(watchdog_[a-z_]+|process_[a-z_]+)\b", text)}
    assert read, "no metric names found"
    missing = read - names - recorded
    assert not missing, f"read but not exported: {sorted(missing)}"


def test_the_exporter_records_capture_and_recovery_durations_from_events() -> None:
    e = Exporter()
    e.observe_record({"event": "evidence_checked", "capture_seconds": 2.5})
    e.observe_record({"event": "evidence_captured", "capture_seconds": 4.0})
    e.observe_record({"event": "recovered", "downtime": 75.0})
    for bad in ({"event": "recovered"}, {"event": "recovered", "downtime": "soon"}, {"event": "recovered",
                "downtime": -1}, {"event": "evidence_checked", "capture_seconds": True}, {"event": "transition"}):
        e.observe_record(bad)  # ignored, never an error
    get = e.registry.get_sample_value
    assert get("watchdog_capture_seconds_count", {"event": "evidence_checked"}) == 1
    assert get("watchdog_capture_seconds_sum", {"event": "evidence_captured"}) == 4.0
    assert get("watchdog_recovery_downtime_seconds_count") == 1
    assert get("watchdog_recovery_downtime_seconds_sum") == 75.0
    assert get("watchdog_incident_events_total", {"event": "recovered"}) == 0  # shown from the start, at 0
