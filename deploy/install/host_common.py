"""What the host install and uninstall share: the paths they own, the install record, dpkg, apt and systemctl.

Run by the host's own python3 (>= 3.11) from scripts/install and scripts/uninstall: the standard library only, and
every program run as an argv list with a timeout. docs/install.md says what goes where and why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

OPT = Path("/opt/engine-watchdog")
VENV_LINK = OPT / ".venv"  # what the unit, runbooks and manifests name: a link to the venv in use under VENVS
VENVS = OPT / ".venvs"
RECORD = OPT / "install.json"
ETC = Path("/etc/engine-watchdog")
CONFIG = ETC / "config.toml"
ENV_FILE = ETC / "env"
STATE = Path("/var/lib/engine-watchdog")
UNIT_NAME = "engine-watchdog.service"
UNIT = Path("/etc/systemd/system") / UNIT_NAME
# One watchdog per engine on a host with several: engine-watchdog@NAME.service, config /etc/engine-watchdog/NAME.toml,
# secrets NAME.env, state /var/lib/engine-watchdog/NAME (docs/systemd.md). Made from the one shipped unit.
TEMPLATE_NAME = "engine-watchdog@.service"
TEMPLATE = UNIT.with_name(TEMPLATE_NAME)
INSTANCES = "engine-watchdog@*.service"
# (what the shipped unit says, what an instance says instead): each must be found exactly where it is expected
_INSTANCE_EDITS = (
    ("Description=engine-watchdog: detects frozen vLLM engines",
     "Description=engine-watchdog %i: detects frozen vLLM engines"),
    ("ExecStartPre=/opt/engine-watchdog/.venv/bin/watchdog config check --config /etc/engine-watchdog/config.toml",
     "ExecStartPre=/opt/engine-watchdog/.venv/bin/watchdog config check --config /etc/engine-watchdog/%i.toml"),
    ("ExecStart=/opt/engine-watchdog/.venv/bin/watchdog run --config /etc/engine-watchdog/config.toml",
     "ExecStart=/opt/engine-watchdog/.venv/bin/watchdog run --config /etc/engine-watchdog/%i.toml "
     "--state-dir /var/lib/engine-watchdog/%i"),
    ("StateDirectory=engine-watchdog", "StateDirectory=engine-watchdog/%i"),
    ("EnvironmentFile=-/etc/engine-watchdog/env", "EnvironmentFile=-/etc/engine-watchdog/%i.env"),
)
SYSTEMD_RUNNING = Path("/run/systemd/system")  # sd_booted(): systemd is PID 1 here
# The only system packages the install may add (Debian, Ubuntu): venv's ensurepip, which Debian splits out of
# python3, and the distro's systemd bindings (sd_notify through libsystemd, journal fields).
PACKAGES = ("python3-venv", "python3-systemd")
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C.UTF-8"}


class Failure(Exception):
    """A reason to stop, said in one line (exit 1)."""


def fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr, named as the operator ran it (scripts/install, scripts/uninstall), and exit."""
    name = "scripts/" + Path(sys.argv[0]).stem.removeprefix("host_")
    print(f"{name}: {message}", file=sys.stderr)
    sys.exit(code)


class Parser(argparse.ArgumentParser):
    """Usage errors exit 64 (EX_USAGE), as the watchdog's own."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        fail(message, 64)


def say(message: str) -> None:
    print(message, flush=True)


def run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`argv` with its output captured (stderr into stdout); a missing program or a timeout is a Failure."""
    # The operator's PIP_* and proxy settings pass through; PYTHON* would reach into the venv's interpreter.
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | dict(env or {})
    try:
        return subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, check=False, env=full_env, cwd=cwd, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise Failure(f"{argv[0]}: not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise Failure(f"{' '.join(argv[:3])} ... ran past {timeout:.0f} s") from exc


def tail(output: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in output.rstrip().splitlines()[-lines:])


def last_line(output: str) -> str:
    """The line that says why: the last error line of pip or apt (E:), else the last line."""
    kept = [line.strip() for line in output.splitlines() if line.strip()]
    for prefix in ("ERROR:", "E:", "error:"):  # pip's own reason before its subprocess's summary
        errors = [line for line in kept if line.startswith(prefix)]
        if errors:
            return errors[-1]
    return kept[-1] if kept else "no output"


def require_root() -> None:
    if os.geteuid() != 0:
        fail("must run as root (it writes /opt, /etc and /var/lib, and runs apt-get and systemctl)")


def program(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin")


# --- the install record ---------------------------------------------------------------------------------------


def read_record() -> dict[str, Any] | None:
    try:
        record = json.loads(RECORD.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot read the install record {RECORD}: {exc}") from exc
    if not isinstance(record, dict):
        raise Failure(f"{RECORD} is not an install record")
    return record


def write_record(record: Mapping[str, Any]) -> None:
    OPT.mkdir(mode=0o755, parents=True, exist_ok=True)
    partial = RECORD.with_name(RECORD.name + ".partial")
    partial.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    partial.replace(RECORD)


def point_link(target: Path) -> None:
    """VENV_LINK to `target` by rename(2): it names the old venv or the new one, never nothing."""
    staged = OPT / ".venv.link"
    staged.unlink(missing_ok=True)
    staged.symlink_to(target.relative_to(OPT))
    staged.replace(VENV_LINK)


def merged(old: Iterable[str], new: Iterable[str]) -> list[str]:
    return sorted({*old, *new})


# --- dpkg and apt ---------------------------------------------------------------------------------------------


def has_apt() -> bool:
    return program("apt-get") is not None and program("dpkg-query") is not None


def package_states() -> dict[str, str]:
    """dpkg's state of every package it knows: 'ii' installed, 'rc' removed with its config files left, ..."""
    r = run([program("dpkg-query") or "dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\n"], 120)
    if r.returncode != 0:
        raise Failure(f"dpkg-query failed: {last_line(r.stdout)}")
    pairs = (line.split("\t", 1) for line in r.stdout.splitlines() if "\t" in line)
    return {name: state.strip() for state, name in pairs}


def installed_packages() -> set[str]:
    return {name for name, state in package_states().items() if state == "ii"}


def apt_get(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    # A host's own apt run (unattended-upgrades) holds dpkg's lock for a while: wait for it rather than fail.
    return run([program("apt-get") or "apt-get", "-o", "DPkg::Lock::Timeout=300", *args], timeout, env=APT_ENV)


def simulated_removals(packages: Sequence[str]) -> set[str] | None:
    """What `apt-get remove PACKAGES` would remove (its reverse dependencies too); None when apt refuses."""
    r = apt_get("-s", "remove", *packages, timeout=120)
    if r.returncode != 0:
        return None
    return {line.split()[1].split(":")[0] for line in r.stdout.splitlines() if line.startswith("Remv ")}


def manual_packages() -> set[str]:
    r = run([program("apt-mark") or "apt-mark", "showmanual"], 120, env=APT_ENV)
    return set(r.stdout.split()) if r.returncode == 0 else set()


# --- systemd ----------------------------------------------------------------------------------------------------


def systemd_running() -> bool:
    return SYSTEMD_RUNNING.is_dir()


def systemctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str] | None:
    """systemctl ARGS, or None where there is no systemctl."""
    binary = program("systemctl")
    return run([binary, *args], timeout) if binary else None


def instance_unit(shipped: str) -> str:
    """The template unit, engine-watchdog@.service, from the shipped engine-watchdog.service: its config, secrets and
    state per instance (%i), everything else (the hardening) as shipped. Raises ValueError if a line it edits is not
    in the shipped unit exactly once (the two must never drift apart silently)."""
    lines = shipped.splitlines(keepends=True)
    for old, new in _INSTANCE_EDITS:
        at = [i for i, line in enumerate(lines) if line.rstrip("\n") == old]
        if len(at) != 1:
            raise ValueError(f"the shipped unit has {len(at)} lines {old!r}, not one: the template cannot be made")
        lines[at[0]] = new + "\n"
    return "".join(lines)


def active_units(states: str = "active") -> list[str]:
    """The watchdog's units in one of ``states`` now (systemctl's list): engine-watchdog.service and every
    engine-watchdog@NAME.service; "active,activating,deactivating,reloading": one restarting in a loop too."""
    if not systemd_running():
        return []
    r = systemctl("list-units", f"--state={states}", "--plain", "--no-legend", "--type=service", UNIT_NAME,
                  INSTANCES)
    if r is None or r.returncode != 0:
        return []
    return [line.split()[0] for line in r.stdout.splitlines() if line.split()]


def unit_active() -> bool:
    return bool(active_units())


def daemon_reload() -> None:
    if systemd_running():
        r = systemctl("daemon-reload")
        if r is not None and r.returncode != 0:
            raise Failure(f"systemctl daemon-reload failed: {last_line(r.stdout)}")
        say("systemd: daemon-reload")
