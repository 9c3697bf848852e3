"""The unit file we ship, systemd/engine-watchdog.service, tested as shipped.

`systemd-analyze verify` checks it; then its own lines run in a throwaway systemd (tests/harness/systemd_ns.py),
hardening included (ProtectSystem=strict, ProtectHome=read-only, PrivateTmp=yes, NoNewPrivileges=yes,
AmbientCapabilities=CAP_SYS_PTRACE, StateDirectory=). Only two paths are substituted: the program (this checkout's
venv instead of /opt/engine-watchdog/.venv) and the config (the test's own instead of /etc/engine-watchdog/). One
drop-in shortens WatchdogSec to 3 s while the config scrapes every 10 s: the loop must wake up to ping between
passes. The watchdog watches a port where nothing listens (it says `down`): no vLLM needed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from tests.harness.systemd_ns import ThrowawaySystemd, available

CHECKOUT = Path(__file__).resolve().parents[2]
SHIPPED = CHECKOUT / "systemd" / "engine-watchdog.service"
UNIT = "engine-watchdog.service"
SHIPPED_PROGRAM = "/opt/engine-watchdog/.venv/bin/watchdog"
SHIPPED_CONFIG = "/etc/engine-watchdog/config.toml"
PROGRAM = str(Path(sys.prefix) / "bin" / "watchdog")  # this checkout's venv (the harness keeps it visible inside)
# PrivateTmp= gives the unit a /tmp of its own: a checkout under /tmp (a CI clone, say) is not there. Then the checkout
# and its venv's packages are shown at a second place inside, and the unit runs the venv's interpreter on a launcher.
HIDDEN = any(CHECKOUT.resolve().is_relative_to(d) for d in ("/tmp", "/var/tmp"))
ALIAS = "/run/engine-watchdog-checkout"
LAUNCHER = "/run/engine-watchdog-test/launch.py"
SITE = next(Path(sys.prefix).glob("lib/python3*/site-packages"))
LAUNCH_PY = f"""\
import sys
sys.path[:0] = ["{ALIAS}/src", "{ALIAS}/site-packages"]
from watchdog.cli.main import main
sys.exit(main())
"""
PROGRAM_ARGV = f"{Path(sys.executable).resolve()} {LAUNCHER}" if HIDDEN else PROGRAM
CONFIG = "/run/engine-watchdog-test/config.toml"
DROP_IN = f"/run/systemd/system/{UNIT}.d/50-short-watchdog.conf"
WATCHDOG_SEC = 3
SCRAPE_INTERVAL = 10.0  # longer than WatchdogSec: pings between passes or systemd kills it
CONFIG_TOML = f"""\
[engine]
url = "http://127.0.0.1:8000"   # the namespace's own loopback: nothing listens there
[scrape]
interval = {SCRAPE_INTERVAL}
"""
STATE = "/var/lib/engine-watchdog"  # StateDirectory=engine-watchdog, and the config's default state.dir

T = TypeVar("T")


def unit_for_test() -> str:
    """The shipped file with the program and config paths pointed at this checkout and the test's config."""
    shipped = SHIPPED.read_text()
    text = shipped.replace(SHIPPED_PROGRAM, PROGRAM_ARGV).replace(SHIPPED_CONFIG, CONFIG)
    changed = [(a, b) for a, b in zip(shipped.splitlines(), text.splitlines(), strict=True) if a != b]
    assert [a.split("=", 1)[0] for a, _ in changed] == ["ExecStart"], changed  # nothing else touched
    return text


def wait_for(what: str, timeout: float, check: Callable[[], T | None], every: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f}s")
        time.sleep(every)


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


@pytest.fixture
def sd(tmp_path: Path) -> Iterator[ThrowawaySystemd]:
    reason = available()
    if reason is not None:
        pytest.fail(f"a throwaway systemd cannot run on this machine: {reason}")
    ns = ThrowawaySystemd(
        "shipped-unit",
        {UNIT: unit_for_test()},
        files={CONFIG: CONFIG_TOML, DROP_IN: f"[Service]\nWatchdogSec={WATCHDOG_SEC}\n",
               **({LAUNCHER: LAUNCH_PY} if HIDDEN else {})},
        binds={str(CHECKOUT): f"{ALIAS}/src", str(SITE): f"{ALIAS}/site-packages"} if HIDDEN else None,
        private_dirs=["/var/lib"],  # StateDirectory= creates /var/lib/engine-watchdog: inside, never on the machine
        log_dir=tmp_path / "systemd",
    )
    with ns:
        try:
            yield ns
        except BaseException:
            with contextlib.suppress(Exception):
                print(f"--- {UNIT} ---\n{ns.status(UNIT)}\n{ns.journal(UNIT, lines=80)}")
            raise


def test_the_shipped_unit_runs_pings_restarts_and_stops(sd: ThrowawaySystemd) -> None:
    # 1. Type=notify: active only once the watchdog sent READY=1, with the shipped lines in force
    first = sd.wait_active(UNIT, timeout=60)
    shown = {p: sd.show(UNIT, p) for p in ("Type", "NotifyAccess", "Restart", "ProtectSystem", "ProtectHome",
                                            "PrivateTmp", "NoNewPrivileges", "AmbientCapabilities",
                                            "StateDirectory", "WatchdogUSec")}
    assert shown == {"Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "ProtectSystem": "strict",
                     "ProtectHome": "read-only", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                     "AmbientCapabilities": "cap_sys_ptrace", "StateDirectory": "engine-watchdog",
                     "WatchdogUSec": f"{WATCHDOG_SEC}s"}, shown
    # ... and the kernel's view of the process agrees: the hardening holds inside the namespace
    status = dict(line.split(":\t", 1) for line in sd.read_file(f"/proc/{first}/status").splitlines() if ":\t" in line)
    assert int(status["CapAmb"], 16) == 1 << 19 and status["NoNewPrivs"] == "1", status  # 19: CAP_SYS_PTRACE
    mounts = {f[4]: f[5].split(",")[0] for line in sd.read_file(f"/proc/{first}/mountinfo").splitlines()
              if (f := line.split())}
    assert mounts["/"] == "ro" and mounts[STATE] == "rw" and mounts["/tmp"] == "rw", mounts
    environ = dict(v.split("=", 1) for v in sd.read_file(f"/proc/{first}/environ").split("\0") if "=" in v)
    assert environ["WATCHDOG_PID"] == str(first) and environ["WATCHDOG_USEC"] == f"{WATCHDOG_SEC}000000", environ
    wait_for("a down transition in the StateDirectory's events.jsonl", 30,
             lambda: '"to": "down"' in sd.run(["cat", f"{STATE}/events.jsonl"]).stdout)
    assert "engine server: down" in sd.show(UNIT, "StatusText")

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
    assert after == {"ActiveState": "inactive", "Result": "success", "ExecMainCode": "1", "ExecMainStatus": "0"}, after
    assert "stopped by SIGTERM" in sd.journal(UNIT, lines=50)
