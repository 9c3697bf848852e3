"""The shipped unit's hardening, held: `systemd-analyze security --offline=true` scores it no worse than the 2.8 the
docs state (its --threshold, which an unhardened unit fails), and no option the watchdog needs is taken away (each
with what would break). What the sandbox really allows: tests/engine/test_unit_sandbox.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.harness.shipped_unit import SHIPPED, SHIPPED_CONFIG, SHIPPED_PROGRAM, service_settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "systemd.md"
SCORE = 2.8  # systemd-analyze's overall exposure, 0 (best) to 10
THRESHOLD = round(SCORE * 10)  # --threshold= is on a 0-100 scale
OVERALL = re.compile(r"Overall exposure level for \S+: (\d+\.\d) (\w+)")


def analyze(unit: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", *extra, str(unit)],
                          capture_output=True, text=True, timeout=60, start_new_session=True, check=False)


def exposure(unit: Path) -> tuple[float, str]:
    found = OVERALL.search(analyze(unit).stdout)
    assert found, f"no overall exposure from systemd-analyze for {unit}"
    return float(found.group(1)), found.group(2)


def test_the_security_score_is_held_at_its_threshold() -> None:
    r = analyze(SHIPPED, f"--threshold={THRESHOLD}")
    assert r.returncode == 0, f"exposure above {SCORE}:\n{r.stdout[-3000:]}{r.stderr}"
    assert exposure(SHIPPED) == (SCORE, "OK")


def test_the_threshold_refuses_the_unit_without_its_sandbox(tmp_path: Path) -> None:
    kept = ("Type", "WatchdogSec", "NotifyAccess", "ExecStartPre", "ExecStart", "StateDirectory", "Restart")
    bare = tmp_path / "engine-watchdog.service"
    bare.write_text("[Unit]\nDescription=the shipped unit less its sandbox\n[Service]\n" + "".join(
        f"{k}={v}\n" for k, v in service_settings(SHIPPED.read_text()) if k.startswith(kept)))
    assert analyze(bare, f"--threshold={THRESHOLD}").returncode != 0
    assert exposure(bare)[0] > 9.0


def test_the_docs_state_the_scores_measured() -> None:
    text = DOCS.read_text()
    assert f"now **{SCORE} OK**" in text and "before this hardening **9.0 UNSAFE**" in text
    assert f"--threshold={THRESHOLD}" in text


def settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, value in service_settings(SHIPPED.read_text()):
        out.setdefault(key, []).append(value)
    return out


def words(key: str) -> set[str]:
    return {w for value in settings().get(key, []) for w in value.split()}


# (setting, what it must allow, what breaks without it)
NEEDED = [
    ("AmbientCapabilities", {"CAP_SYS_PTRACE"}, "py-spy cannot read the stacks of engine processes"),
    ("CapabilityBoundingSet", {"CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_KILL"},
     "py-spy, other users' logs and pipes, the /dev/shm sweep of a container, a step's kill"),
    ("RestrictAddressFamilies", {"AF_UNIX", "AF_INET", "AF_INET6"}, "systemctl, docker, ssh, scrapes, alerts"),
    ("SystemCallFilter", {"ptrace"}, "py-spy cannot attach"),
    ("StateDirectory", {"engine-watchdog"}, "no state directory to write"),
    ("RestartPreventExitStatus", {"64"}, "a bad config restarts for ever"),
]


@pytest.mark.parametrize(("key", "wanted", "why"), NEEDED, ids=[n[0] for n in NEEDED])
def test_what_the_watchdog_needs_is_granted(key: str, wanted: set[str], why: str) -> None:
    assert wanted <= words(key), f"{key}= lacks {sorted(wanted - words(key))}: {why}"


# (setting, values it must not take, what breaks)
FORBIDDEN = [
    ("User", None, "systemctl and the Docker socket need root"),
    ("DynamicUser", None, "systemctl and the Docker socket need root"),
    ("PrivateDevices", None, "a private /dev/shm (no sweep of the engine's) and no /dev/nvidia* for NVML"),
    ("DevicePolicy", None, "NVML needs /dev/nvidia*"),
    ("DeviceAllow", None, "an allow list shuts out /dev/nvidia*"),
    ("PrivateNetwork", None, "no scrape, alert or ssh"),
    ("IPAddressDeny", None, "engines, receivers and nodes are at any address"),
    ("PrivateUsers", None, "ptrace of root's processes"),
    ("ProcSubset", None, "/proc/sys (Yama's ptrace_scope) and /proc/net (a port's listener)"),
    ("PrivateIPC", None, "the engine's IPC namespace"),
    ("ProtectHome", {"yes", "tmpfs"}, "an engine's venv in a home directory unreadable"),
    ("ProtectProc", {"noaccess"}, "other processes' /proc unreadable"),
]


@pytest.mark.parametrize(("key", "refused", "why"), FORBIDDEN, ids=[f[0] for f in FORBIDDEN])
def test_nothing_the_watchdog_needs_is_taken_away(key: str, refused: set[str] | None, why: str) -> None:
    given = settings().get(key)
    if refused is None:
        assert given is None, f"{key}={given}: {why}"
    else:
        assert not set(given or ()) & refused, f"{key}={given}: {why}"


def test_the_config_is_checked_before_the_start_with_the_same_file() -> None:
    s = settings()
    config = ["--config", SHIPPED_CONFIG]
    assert s["ExecStart"] == [" ".join([SHIPPED_PROGRAM, "run", *config])]
    assert s["ExecStartPre"] == [" ".join([SHIPPED_PROGRAM, "config", "check", *config])]
    assert s["Restart"] == ["on-failure"] and s["Type"] == ["notify"]
    unit = SHIPPED.read_text()  # the start limit ends the retries of a config the check refuses
    assert "\nStartLimitIntervalSec=60\n" in unit and "\nStartLimitBurst=5\n" in unit
