"""The unit file we ship, systemd/engine-watchdog.service, tested as shipped.

`systemd-analyze verify` checks it; then its own lines run in a throwaway systemd (tests/harness/systemd_ns.py,
the paths substituted by tests/harness/shipped_unit.py), hardening included. One drop-in shortens WatchdogSec to
3 s while the config scrapes every 10 s: the loop must wake up to ping between passes. The watchdog watches a port
where nothing listens (it says `down`): no vLLM needed. Then: a bad config is not restarted for ever; a command
step with ``transient_unit`` starts a process outside the watchdog's cgroup that outlives `systemctl restart
engine-watchdog`, while what a plain command step starts dies with it. What the sandbox allows:
tests/engine/test_unit_sandbox.py; its score: tests/unit/test_unit_hardening.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.shipped_unit import (
    SHIPPED,
    SHIPPED_PROGRAM,
    STATE,
    TEMPLATE,
    UNIT,
    config_check_missing,
    shipped_systemd,
    template_for_test,
    unit_for_test,
    wait_for,
)
from tests.harness.systemd_ns import ThrowawaySystemd

WATCHDOG_SEC = 3
SCRAPE_INTERVAL = 10.0  # longer than WatchdogSec: pings between passes or systemd kills it
CONFIG_TOML = f"""\
[engine]
url = "http://127.0.0.1:8000"   # the namespace's own loopback: nothing listens there
[scrape]
interval = {SCRAPE_INTERVAL}
"""
SHORT_WATCHDOG = {"50-short-watchdog.conf": f"[Service]\nWatchdogSec={WATCHDOG_SEC}\n"}

def test_systemd_analyze_verify_accepts_the_shipped_unit(tmp_path: Path) -> None:
    as_shipped = subprocess.run(["systemd-analyze", "verify", str(SHIPPED)], capture_output=True, text=True,
                                timeout=60, start_new_session=True, check=False)
    # here the only complaint is that /opt/engine-watchdog is not installed on this machine
    complaints = [line for line in (as_shipped.stdout + as_shipped.stderr).splitlines() if line.strip()]
    assert complaints and all(SHIPPED_PROGRAM in line for line in complaints), complaints
    stand_in = tmp_path / UNIT
    stand_in.write_text(unit_for_test())
    r = subprocess.run(["systemd-analyze", "verify", str(stand_in)], capture_output=True, text=True, timeout=60,
                       start_new_session=True, check=False)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    # the template the installer makes from it, verified as an instance (engine-watchdog@b.service)
    (tmp_path / TEMPLATE).write_text(template_for_test())
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "engine-watchdog@b.service")], capture_output=True,
                       text=True, timeout=60, start_new_session=True, check=False, cwd=tmp_path)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


@contextlib.contextmanager
def running(ns: ThrowawaySystemd) -> Iterator[ThrowawaySystemd]:
    with ns:
        try:
            yield ns
        except BaseException:
            with contextlib.suppress(Exception):
                print(f"--- {UNIT} ---\n{ns.status(UNIT)}\n{ns.journal(UNIT, lines=80)}")
            raise


def proc_status(sd: ThrowawaySystemd, pid: int) -> dict[str, str]:
    text = sd.read_file(f"/proc/{pid}/status")
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def test_the_shipped_unit_runs_pings_restarts_and_stops(tmp_path: Path) -> None:
    with running(shipped_systemd("shipped-unit", tmp_path / "systemd", CONFIG_TOML, drop_ins=SHORT_WATCHDOG)) as sd:
        # 1. Type=notify: active only once the watchdog sent READY=1, with the shipped lines in force
        first = sd.wait_active(UNIT, timeout=60)
        shown = {p: sd.show(UNIT, p) for p in ("Type", "NotifyAccess", "Restart", "ProtectSystem", "ProtectHome",
                                                "PrivateTmp", "NoNewPrivileges", "AmbientCapabilities",
                                                "StateDirectory", "WatchdogUSec", "RestartPreventExitStatus",
                                                "ProtectProc", "RestrictNamespaces")}
        assert shown == {"Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "ProtectSystem": "strict",
                         "ProtectHome": "read-only", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                         "AmbientCapabilities": "cap_sys_ptrace", "StateDirectory": "engine-watchdog",
                         "WatchdogUSec": f"{WATCHDOG_SEC}s", "RestartPreventExitStatus": "64",
                         "ProtectProc": "invisible", "RestrictNamespaces": "yes"}, shown
        # ... and the kernel's view of the process agrees: the hardening holds inside the namespace
        status = proc_status(sd, first)
        # 19: CAP_SYS_PTRACE; with 1 DAC_OVERRIDE, 2 DAC_READ_SEARCH, 3 FOWNER, 5 KILL the whole bounding set
        assert int(status["CapAmb"], 16) == 1 << 19 and status["NoNewPrivs"] == "1", status
        assert int(status["CapBnd"], 16) == (1 << 19) | 0b101110 and status["Seccomp"] == "2", status
        mounts = {f[4]: f[5].split(",")[0] for line in sd.read_file(f"/proc/{first}/mountinfo").splitlines()
                  if (f := line.split())}
        assert mounts["/"] == "ro" and mounts[STATE] == "rw" and mounts["/tmp"] == "rw", mounts
        assert mounts["/proc/sys"] == "ro" and mounts["/sys/fs/cgroup"] == "ro", mounts
        environ = dict(v.split("=", 1) for v in sd.read_file(f"/proc/{first}/environ").split("\0") if "=" in v)
        assert environ["WATCHDOG_PID"] == str(first) and environ["WATCHDOG_USEC"] == f"{WATCHDOG_SEC}000000", environ
        wait_for("a down transition in the StateDirectory's events.jsonl", 30,
                 lambda: '"to": "down"' in sd.run(["cat", f"{STATE}/events.jsonl"]).stdout)
        assert "engine server: down" in sd.show(UNIT, "StatusText")
        # its exporter answers on its port (inside the namespace)
        get = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9830/metrics', timeout=10).read())"
        page = sd.run([sys.executable, "-c", get], timeout=30)
        assert page.returncode == 0 and "watchdog_engine_state" in page.stdout, page.stderr

        # 2. WATCHDOG=1 between passes: systemd's WatchdogTimestamp moves on, and it never had to kill the watchdog
        stamps: set[str] = set()

        def pinged_thrice() -> bool:
            if sd.show(UNIT, "NRestarts") != "0":
                raise AssertionError(f"systemd restarted the watchdog:\n{sd.journal(lines=40)}")
            stamps.add(sd.show(UNIT, "WatchdogTimestampMonotonic"))
            return len(stamps - {"0"}) >= 4  # the first seen may be READY's; three more pings after it

        wait_for("four watchdog timestamps", 30, pinged_thrice, every=0.5)
        assert sd.main_pid(UNIT) == first and sd.show(UNIT, "NRestarts") == "0" and sd.is_active(UNIT)
        assert "watchdog timeout" not in sd.journal(lines=200).lower()

        # 3. SIGKILL of its main process: Restart=on-failure brings it back (RestartSec=5), a new READY=1
        os.kill(sd.host_pid(first), signal.SIGKILL)
        wait_for("a restart", 60, lambda: sd.show(UNIT, "NRestarts") == "1" and sd.is_active(UNIT))
        second = sd.main_pid(UNIT)
        assert second not in (0, first), (first, second)

        # 4. `systemctl stop`: SIGTERM, STOPPING=1, exit 0
        sd.systemctl("stop", UNIT, timeout=60)
        after = {p: sd.show(UNIT, p) for p in ("ActiveState", "Result", "ExecMainCode", "ExecMainStatus")}
        assert after == {"ActiveState": "inactive", "Result": "success", "ExecMainCode": "1",
                         "ExecMainStatus": "0"}, after
        assert "stopped by SIGTERM" in sd.journal(UNIT, lines=50)


BAD_CONFIG = '[judge]\nstall_windw = 30.0\n'
QUICK_RESTART = {"50-quick-restart.conf": "[Service]\nRestartSec=1\n"}  # the start limit's 60 s window: seconds


def settled(sd: ThrowawaySystemd) -> dict[str, str] | None:
    """The unit's end state once systemd stopped trying (failed, no restart job queued), else None."""
    state = {p: sd.show(UNIT, p) for p in ("ActiveState", "Result", "NRestarts", "ExecMainStatus")}
    jobs = sd.systemctl("list-jobs", "--no-legend", check=False).stdout
    return state if state["ActiveState"] == "failed" and UNIT not in jobs else None


def test_a_bad_config_exits_64_and_is_not_restarted(tmp_path: Path) -> None:
    # the main process's own check, the ExecStartPre= aside: RestartPreventExitStatus=64 ends it at once
    ns = shipped_systemd("bad-config", tmp_path / "systemd", BAD_CONFIG, drop_ins=QUICK_RESTART, pre_check=False)
    with running(ns) as sd:
        # a restart to come shows as activating (auto-restart), never failed
        state = wait_for("the unit to fail and stay failed", 60, lambda: settled(sd), every=0.5)
        assert state == {"ActiveState": "failed", "Result": "exit-code", "NRestarts": "0", "ExecMainStatus": "64"}
        assert "unknown key judge.stall_windw" in sd.journal(UNIT, lines=50)


def test_the_pre_start_check_refuses_a_bad_config_and_the_start_limit_ends_the_retries(tmp_path: Path) -> None:
    missing = config_check_missing()
    if missing is not None:
        pytest.skip(f"the unit's ExecStartPre= cannot run: {missing}")
    ns = shipped_systemd("bad-config-pre", tmp_path / "systemd", BAD_CONFIG, drop_ins=QUICK_RESTART)
    with running(ns) as sd:
        state = wait_for("the start limit to end the retries", 90, lambda: settled(sd), every=0.5)
        journal = sd.journal(UNIT, lines=200)
        assert "unknown key judge.stall_windw" in journal and "Start request repeated too quickly" in journal
        # StartLimitBurst=5: five starts, each refused by the check (the watchdog itself never ran), then the fifth
        # restart is refused by the start limit (systemd counts it in NRestarts)
        assert journal.count("Control process exited, code=exited, status=64/USAGE") == 5, journal
        assert state["NRestarts"] == "5" and state["ExecMainStatus"] == "0", state
        assert sd.show(UNIT, "ExecMainPID") == "0"
        r = sd.systemctl("start", UNIT, check=False, timeout=60)  # by hand: refused at once, with the reason
        assert r.returncode != 0


# --- a command step that starts an engine: outside the watchdog's unit with transient_unit

PLAIN_CHILD = ("/bin/sleep", "3601")  # what the plain command step leaves running (setsid --fork: it returns)
ENGINE = ("/bin/sleep", "3602")  # the stand-in engine the transient step starts
TRANSIENT = "fake-engine.service"
STEPS_TOML = f"""\
[engine]
url = "http://127.0.0.1:8000"   # nothing listens: down, then an incident, then the restart
[scrape]
interval = 1.0
[capture]
enabled = false
[restart]
down_after = 1.0
budget = 1                      # one restart: none after the watchdog's own restart
[[restart.steps]]
kind = "command"
argv = {json.dumps(["/usr/bin/setsid", "--fork", *PLAIN_CHILD])}
timeout = 30.0
[[restart.steps]]
kind = "command"
argv = {json.dumps(list(ENGINE))}
transient_unit = "{TRANSIENT}"
# the throwaway systemd never reaches sysinit.target (a real host does: leave this out there)
unit_properties = ["DefaultDependencies=no"]
timeout = 60.0
"""


def pids_of(sd: ThrowawaySystemd, unit: str, argv: tuple[str, ...]) -> list[int]:
    """The processes of ``unit``'s cgroup whose command line is ``argv``."""
    cgroup = sd.show(unit, "ControlGroup")
    if not cgroup:
        return []
    procs = sd.run(["cat", f"/sys/fs/cgroup{cgroup}/cgroup.procs"]).stdout.split()
    return [int(p) for p in procs if sd.run(["cat", f"/proc/{p}/cmdline"]).stdout.split("\0")[:-1] == list(argv)]


def alive(sd: ThrowawaySystemd, pid: int, start: str) -> bool:
    r = sd.run(["cat", f"/proc/{pid}/stat"])
    return r.returncode == 0 and r.stdout.rpartition(")")[2].split()[19] == start


def test_a_transient_step_starts_an_engine_that_outlives_the_watchdogs_restart(tmp_path: Path) -> None:
    with running(shipped_systemd("transient-step", tmp_path / "systemd", STEPS_TOML)) as sd:
        sd.wait_active(UNIT, timeout=60)
        wait_for(f"{TRANSIENT} started by the restart", 60, lambda: sd.is_active(TRANSIENT), every=0.5)
        engine = sd.main_pid(TRANSIENT)
        (plain,) = wait_for("the plain step's child", 30, lambda: pids_of(sd, UNIT, PLAIN_CHILD))
        assert pids_of(sd, TRANSIENT, ENGINE) == [engine] and not pids_of(sd, UNIT, ENGINE)
        unified = [line for line in sd.read_file(f"/proc/{engine}/cgroup").splitlines() if line.startswith("0::")]
        assert unified == [f"0::/system.slice/{TRANSIENT}"], unified
        # started by systemd itself: none of the watchdog's sandbox
        status = proc_status(sd, engine)
        assert status["NoNewPrivs"] == "0" and int(status["CapBnd"], 16) > (1 << 19) | 0b101110, status
        steps = wait_for("the restart_steps event", 30, lambda: [
            e for e in map(json.loads, sd.run(["cat", f"{STATE}/events.jsonl"]).stdout.splitlines())
            if e.get("event") == "restart_steps"])
        records = [r for r in steps[0]["steps"] if r["what"] != "shm check"]
        assert [(r["what"], r["ok"], r["rc"]) for r in records] == [
            ("command /usr/bin/setsid", True, 0), (f"command stop {TRANSIENT} (its transient unit)", True, 5),
            (f"command /bin/sleep as {TRANSIENT}", True, 0)], records
        assert records[1]["note"] == "not loaded: nothing ran as it"
        starts = {pid: sd.read_file(f"/proc/{pid}/stat").rpartition(")")[2].split()[19] for pid in (engine, plain)}

        before = sd.main_pid(UNIT)
        sd.systemctl("restart", UNIT, timeout=90)
        assert sd.wait_active(UNIT, timeout=60) != before
        wait_for("the plain step's child to end with the watchdog's cgroup", 30,
                 lambda: not alive(sd, plain, starts[plain]))
        assert alive(sd, engine, starts[engine]) and sd.main_pid(TRANSIENT) == engine and sd.is_active(TRANSIENT)
        assert sd.show(UNIT, "NRestarts") == "0"  # restarted by hand, not by a failure

        # the engine is stopped with its own unit, not by anything done to the watchdog
        sd.systemctl("stop", UNIT, timeout=60)
        assert sd.is_active(TRANSIENT) and alive(sd, engine, starts[engine])
        sd.systemctl("stop", TRANSIENT, timeout=60)
        assert not alive(sd, engine, starts[engine])

