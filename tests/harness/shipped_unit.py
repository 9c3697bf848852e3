"""The shipped unit, systemd/engine-watchdog.service, as the tests run it in a throwaway systemd (`systemd_ns`).

Only paths are substituted: the program (this checkout's venv instead of /opt/engine-watchdog/.venv) in ExecStart=
and ExecStartPre=, and the config (the test's own instead of /etc/engine-watchdog/). Everything else, the hardening
included, runs as shipped; what a test changes beyond that it says in drop-ins of its own.

PrivateTmp= gives the unit a /tmp of its own: a checkout under /tmp (a CI clone, say) is not there. Then the checkout
and its venv's packages are shown at a second place inside, and the unit runs the venv's interpreter on a launcher.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from tests.harness.systemd_ns import ThrowawaySystemd, available

CHECKOUT = Path(__file__).resolve().parents[2]
SHIPPED = CHECKOUT / "systemd" / "engine-watchdog.service"
UNIT = "engine-watchdog.service"
SHIPPED_PROGRAM = "/opt/engine-watchdog/.venv/bin/watchdog"
SHIPPED_CONFIG = "/etc/engine-watchdog/config.toml"
PROGRAM = str(Path(sys.prefix) / "bin" / "watchdog")  # this checkout's venv (the harness keeps it visible inside)
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
STATE = "/var/lib/engine-watchdog"  # StateDirectory=engine-watchdog, and the config's default state.dir
DROP_INS = f"/run/systemd/system/{UNIT}.d"
# A drop-in's empty ExecStartPre= empties the list: the run without the config check, while `watchdog config check`
# does not exist yet (the verb's owner adds it; `config_check_missing` says so)
NO_PRE_CHECK = "[Service]\nExecStartPre=\n"


def unit_for_test() -> str:
    """The shipped file with the program and config paths pointed at this checkout and the test's config."""
    shipped = SHIPPED.read_text()
    text = shipped.replace(SHIPPED_PROGRAM, PROGRAM_ARGV).replace(SHIPPED_CONFIG, CONFIG)
    changed = [(a, b) for a, b in zip(shipped.splitlines(), text.splitlines(), strict=True) if a != b]
    assert [a.split("=", 1)[0] for a, _ in changed] == ["ExecStartPre", "ExecStart"], changed  # nothing else
    return text


def _host_common() -> ModuleType:
    """deploy/install/host_common.py, the installer's own module (a script beside it, not a package)."""
    spec = importlib.util.spec_from_file_location("host_common", CHECKOUT / "deploy" / "install" / "host_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TEMPLATE = "engine-watchdog@.service"
CONFIG_DIR = "/run/engine-watchdog-test"  # an instance's config: CONFIG_DIR/NAME.toml


def template_for_test() -> str:
    """The template unit as the installer makes it from the shipped unit (`host_common.instance_unit`), with the
    program and the configs' folder pointed at this checkout and the test's files: nothing else differs."""
    made = _host_common().instance_unit(SHIPPED.read_text())
    text = made.replace(SHIPPED_PROGRAM, PROGRAM_ARGV).replace("/etc/engine-watchdog/%i.toml", f"{CONFIG_DIR}/%i.toml")
    changed = [a.split("=", 1)[0] for a, b in zip(made.splitlines(), text.splitlines(), strict=True) if a != b]
    assert changed == ["ExecStartPre", "ExecStart"], changed
    return str(text)


def config_check_missing() -> str | None:
    """Why the unit's ExecStartPre= cannot run here (this checkout's CLI has no `watchdog config check`), or None."""
    r = subprocess.run([PROGRAM, "config", "check", "--help"], capture_output=True, text=True, timeout=60,
                       start_new_session=True, check=False)
    if r.returncode == 0:
        return None
    return ("`watchdog config check` is not in this checkout's CLI yet (its owner is adding it): "
            f"`watchdog config check --help` exits {r.returncode}")


def service_settings(text: str) -> list[tuple[str, str]]:
    """The [Service] section's settings, in order, as (key, value); comments and blank lines left out."""
    out: list[tuple[str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith(("#", ";")) and section == "Service":
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def shipped_systemd(name: str, log_dir: Path, config_toml: str, *, drop_ins: dict[str, str] | None = None,
                    units: dict[str, str] | None = None, files: dict[str, str] | None = None,
                    pre_check: bool = True, binds: dict[str, str] | None = None,
                    wanted: list[str] | None = None) -> ThrowawaySystemd:
    """A throwaway systemd with the shipped unit (and ``units`` beside it), its config, and ``drop_ins`` (file name
    -> text) for it. ``pre_check=False``, or no `watchdog config check` here: its ExecStartPre= emptied. ``binds``:
    more directories shown inside (source -> where, under /run). ``wanted``: the units booted (default: the shipped
    unit and ``units`` but templates)."""
    reason = available()
    if reason is not None:
        raise AssertionError(f"a throwaway systemd cannot run on this machine: {reason}")
    all_drop_ins = dict(drop_ins or {})
    if not pre_check or config_check_missing() is not None:
        all_drop_ins["60-no-config-check.conf"] = NO_PRE_CHECK
    return ThrowawaySystemd(
        name,
        {UNIT: unit_for_test(), **(units or {})},
        wanted=wanted if wanted is not None else [UNIT, *(u for u in (units or {}) if "@." not in u)],
        files={CONFIG: config_toml, **{f"{DROP_INS}/{k}": v for k, v in all_drop_ins.items()},
               **({LAUNCHER: LAUNCH_PY} if HIDDEN else {}), **(files or {})},
        binds={**({str(CHECKOUT): f"{ALIAS}/src", str(SITE): f"{ALIAS}/site-packages"} if HIDDEN else {}),
               **(binds or {})} or None,
        private_dirs=["/var/lib"],  # StateDirectory= creates /var/lib/engine-watchdog: inside, never on the machine
        log_dir=log_dir,
    )


T = TypeVar("T")


def wait_for(what: str, timeout: float, check: Callable[[], T | None], every: float = 0.2) -> T:
    """`check()`'s first truthy answer, asked every `every` s; an AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(every)
