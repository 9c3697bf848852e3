"""A real Prometheus and a real Alertmanager (Debian's prometheus 2.42 and prometheus-alertmanager 0.25) for tests.

Each runs in a session of its own on a loopback port, with its data under the test's directory, and is ended by its
own group in `stop()`. The configurations are the project's shipped examples (deploy/), rewritten only where a
test must: targets, intervals, the rule file's `for:` durations, the webhook's address.

    rules = copy_rules(RULES, tmp / "rules.yml", for_scale=1 / 20, runbook_base="https://runbooks.test/x")
    am = Alertmanager(tmp / "am", alertmanager_config(f"{sink.url}/page", f"{sink.url}/chat", group_wait="1s")).start()
    prom = Prometheus(tmp / "prom", prometheus_config(rules, "127.0.0.1:9830", am.address, interval="1s")).start()
    prom.wait_for(lambda: prom.firing("EngineWatchdogEngineFrozen"), 60, "the frozen alert")
    ...
    prom.stop(); am.stop()
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import requests
import yaml

from tests.harness.server import free_port
from watchdog.host.run import end_group

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "watchdog-rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "watchdog-rules.test.yml"
PROMETHEUS_EXAMPLE = ROOT / "deploy" / "prometheus" / "prometheus.example.yml"
ALERTMANAGER_EXAMPLE = ROOT / "deploy" / "alertmanager" / "alertmanager.example.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "watchdog-dashboard.json"
PROMETHEUS_BIN = Path("/usr/bin/prometheus")
PROMTOOL_BIN = Path("/usr/bin/promtool")
ALERTMANAGER_BIN = Path("/usr/bin/prometheus-alertmanager")
AMTOOL_BIN = Path("/usr/bin/amtool")

T = TypeVar("T")

_FOR = re.compile(r"^(\s+for:\s*)(\S+)\s*$", re.MULTILINE)
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> float:
    """A Prometheus duration ("1m", "90s", "1h30m") in seconds."""
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def copy_rules(src: Path, dst: Path, for_scale: float, runbook_base: str = "") -> dict[str, float]:
    """``src`` copied to ``dst`` with each ``for:`` multiplied by ``for_scale`` (whole seconds, at least 1) and, when
    ``runbook_base`` is given, RUNBOOK_BASE replaced as docs/alerts-and-dashboards.md tells an operator to. Nothing
    else changes. Returns each alert's new ``for:`` in seconds."""
    text = src.read_text()

    def scaled(m: re.Match[str]) -> str:
        return f"{m[1]}{max(1, round(seconds(m[2]) * for_scale))}s"

    out = _FOR.sub(scaled, text)
    if runbook_base:
        out = re.sub(r'^(\s+runbook_url:\s*"?)RUNBOOK_BASE', lambda m: m[1] + runbook_base.rstrip("/"), out,
                     flags=re.MULTILINE)
    dst.write_text(out)
    rules = yaml.safe_load(out)
    return {r["alert"]: seconds(str(r.get("for", "0s"))) for g in rules["groups"] for r in g["rules"] if "alert" in r}


def prometheus_config(rules: Path, watchdog_target: str, alertmanager: str, interval: str = "1s") -> str:
    """deploy/prometheus/prometheus.example.yml with this test's rule file, targets and intervals."""
    cfg = yaml.safe_load(PROMETHEUS_EXAMPLE.read_text())
    cfg["global"].update({"scrape_interval": interval, "evaluation_interval": interval})
    cfg["rule_files"] = [str(rules)]
    cfg["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "engine-watchdog"]
    job["static_configs"] = [{"targets": [watchdog_target]}]
    return yaml.safe_dump(cfg, sort_keys=False)


def alertmanager_config(page_url: str, chat_url: str, group_wait: str = "1s", group_interval: str = "1s") -> str:
    """deploy/alertmanager/alertmanager.example.yml paging ``page_url`` and chatting to ``chat_url``, short waits."""
    cfg = yaml.safe_load(ALERTMANAGER_EXAMPLE.read_text())
    cfg["route"].update({"group_wait": group_wait, "group_interval": group_interval})
    urls = {"engine-pager": page_url, "engine-chat": chat_url}
    assert {r["name"] for r in cfg["receivers"]} == set(urls), cfg["receivers"]
    for receiver in cfg["receivers"]:
        receiver["webhook_configs"][0]["url"] = urls[receiver["name"]]
    return yaml.safe_dump(cfg, sort_keys=False)


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


class _Daemon:
    """A server binary in a session of its own, its output in ``log``, ready once ``/-/ready`` answers 200."""

    name = ""

    def __init__(self, workdir: Path, config_text: str) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = self.dir / "config.yml"
        self.config.write_text(config_text)
        self.log = self.dir / f"{self.name}.log"
        self.port = free_port()
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, ready_timeout: float = 60.0) -> _Daemon:
        with open(self.log, "ab") as out:
            self._popen = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self._popen.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self._popen.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{self.name} not ready in {ready_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM to its group, SIGKILL to what is left after a grace; safe to call twice."""
        p, self._popen = self._popen, None
        if p is not None:
            end_group(p, grace=10.0)

    def __enter__(self) -> _Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Prometheus(_Daemon):
    name = "prometheus"

    def argv(self) -> list[str]:
        return [str(PROMETHEUS_BIN), f"--config.file={self.config}", f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address={self.address}", "--log.level=info"]

    def api(self, path: str, **params: Any) -> Any:
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {r.status_code} {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (vector or matrix results; a scalar is one series without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        return list(self.api(f"label/{label}/values", **{"match[]": match}))

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])

    def firing(self, name: str | None = None) -> list[dict[str, Any]]:
        return [a for a in self.alerts() if a["state"] == "firing" and name in (None, a["labels"]["alertname"])]

    def targets_up(self) -> list[dict[str, Any]]:
        return [t for t in self.api("targets")["activeTargets"] if t["health"] == "up"]


class Alertmanager(_Daemon):
    name = "alertmanager"

    def argv(self) -> list[str]:
        # --cluster.listen-address= : no gossip port (it would bind every address)
        return [str(ALERTMANAGER_BIN), f"--config.file={self.config}", f"--storage.path={self.dir / 'data'}",
                f"--web.listen-address={self.address}", "--cluster.listen-address=", "--log.level=info"]
