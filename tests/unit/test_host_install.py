"""scripts/install and scripts/uninstall: their refusals, each one line and an exit code, before anything is touched.

The scripts run for real, as the unprivileged user `nobody` where the tests run as root (setpriv), so no step here
can write the machine's /opt or /etc. The whole install, upgrade and uninstall in clean Debian roots is
tests/install/. The package decisions of the uninstall ask this machine's own apt (simulations only).
"""

from __future__ import annotations

import importlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL, UNINSTALL = REPO / "scripts" / "install", REPO / "scripts" / "uninstall"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
# As root without setpriv the scripts would run as root: every test that runs them is skipped then.
CANNOT_DROP = bool(NOBODY) and shutil.which("setpriv") is None
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def _python_for_nobody() -> str | None:
    """A CPython >= 3.11 that `nobody` can run (a venv under /root is not one)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/usr/bin/python3.13", "/usr/bin/python3.12",
                      "/usr/bin/python3.11"):
        if not os.access(candidate, os.X_OK):
            continue
        r = subprocess.run([*NOBODY, candidate, "-c", "import sys; print(sys.version_info >= (3, 11))"],
                           capture_output=True, text=True, timeout=30, check=False)
        if r.stdout.strip() == "True":
            return candidate
    return None


PYTHON = None if CANNOT_DROP else _python_for_nobody()
needs_python = pytest.mark.skipif(PYTHON is None, reason="no CPython >= 3.11 outside /root for the user nobody")
unprivileged = pytest.mark.skipif(CANNOT_DROP, reason="runs as root and has no setpriv to drop it")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60, check=False, env=ENV,
                          cwd="/", start_new_session=True)


def _one_line(r: subprocess.CompletedProcess[str], prefix: str) -> str:
    lines = [line for line in r.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory `nobody` can read (pytest's tmp_path is under root's own 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="host-install-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_python
def test_list_packages_is_the_two_system_packages_one_per_line() -> None:
    r = _run(str(INSTALL), "--python", str(PYTHON), "--list-packages")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["python3-venv", "python3-systemd"]


@needs_python
@pytest.mark.parametrize("script", [INSTALL, UNINSTALL], ids=["install", "uninstall"])
def test_a_wrong_option_is_usage_exit_64(script: Path) -> None:
    argv = [str(script), "--python", str(PYTHON)] if script == INSTALL else [str(script)]
    r = _run(*argv, "--no-such-option")
    assert r.returncode == 64, r.stderr
    assert "unrecognized arguments: --no-such-option" in _one_line(r, f"scripts/{script.name}:")


@needs_python
@pytest.mark.parametrize("script", [INSTALL, UNINSTALL], ids=["install", "uninstall"])
def test_not_root_is_refused_before_anything(script: Path) -> None:
    r = _run(str(script), "--python", str(PYTHON)) if script == INSTALL else _run(str(script), "--purge")
    assert r.returncode == 1, r.stderr
    assert "must run as root" in _one_line(r, f"scripts/{script.name}:")
    assert r.stdout == ""


@needs_python
def test_an_unreadable_wheel_is_named_with_the_reason(shared_dir: Path) -> None:
    wheel = shared_dir / "engine_watchdog-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK")
    wheel.chmod(0)
    cases = {str(wheel): "Permission denied",  # never root here: mode 0 keeps it out
             str(shared_dir / "absent.whl"): "No such file or directory",
             str(shared_dir): "not a wheel (*.whl)"}
    for path, reason in cases.items():
        r = _run(str(INSTALL), "--python", str(PYTHON), "--wheel", path)
        assert r.returncode == 1, r.stderr
        line = _one_line(r, "scripts/install:")
        assert path in line
        assert reason in line


@needs_python
def test_find_links_must_be_a_directory(shared_dir: Path) -> None:
    r = _run(str(INSTALL), "--python", str(PYTHON), "--find-links", str(shared_dir / "wheels"))
    assert r.returncode == 1, r.stderr
    assert "not a readable directory" in _one_line(r, "scripts/install:")


@unprivileged
def test_a_python_below_311_is_named_with_its_version(shared_dir: Path) -> None:
    old = shared_dir / "python3.10"
    old.write_text("#!/bin/sh\necho 'cpython 3.10.12 0'\n")  # what the check prints for a 3.10
    old.chmod(0o755)
    r = _run(str(INSTALL), "--python", str(old))
    assert r.returncode == 1, r.stderr
    line = _one_line(r, "scripts/install:")
    assert f"{old} is cpython 3.10.12" in line
    assert "needs CPython >= 3.11" in line


@unprivileged
def test_a_python_that_is_not_cpython_is_refused(shared_dir: Path) -> None:
    pypy = shared_dir / "pypy3"
    pypy.write_text("#!/bin/sh\necho 'pypy 3.11.9 1'\n")
    pypy.chmod(0o755)
    r = _run(str(INSTALL), "--python", str(pypy))
    assert r.returncode == 1, r.stderr
    assert f"{pypy} is pypy 3.11.9" in _one_line(r, "scripts/install:")


@unprivileged
def test_no_python_at_all_says_so(shared_dir: Path) -> None:
    r = _run(str(INSTALL), "--python", str(shared_dir / "python3"))
    assert r.returncode == 1, r.stderr
    assert f"no {shared_dir / 'python3'} here" in _one_line(r, "scripts/install:")


# --- the modules' own decisions, in this process ---------------------------------------------------------------


@pytest.fixture
def modules() -> Iterator[tuple[ModuleType, ModuleType]]:
    sys.path.insert(0, str(REPO / "deploy" / "install"))
    try:
        yield importlib.import_module("host_common"), importlib.import_module("host_uninstall")
    finally:
        sys.path.remove(str(REPO / "deploy" / "install"))


def test_the_reason_given_is_pips_own_error_line(modules: tuple[ModuleType, ModuleType]) -> None:
    hc, _ = modules
    pip = ("Processing ./engine_watchdog-0.1.0\n  ERROR: No matching distribution found for setuptools>=77\n"
           "  [end of output]\nerror: subprocess-exited-with-error\n\n"
           "note: This error originates from a subprocess, and is likely not a problem with pip.\n")
    assert hc.last_line(pip) == "ERROR: No matching distribution found for setuptools>=77"
    apt = "Reading package lists...\nE: Unable to locate package python3-venv\n"
    assert hc.last_line(apt) == "E: Unable to locate package python3-venv"
    assert hc.last_line("one\ntwo\n\n") == "two"


@pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg-query") is None, reason="no apt here")
def test_uninstall_keeps_recorded_packages_that_others_need(modules: tuple[ModuleType, ModuleType],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    hc, uninstall = modules
    installed = hc.installed_packages()
    # libc6: essential, apt refuses; libcurl4 (t64 on Debian 13), where curl is installed: curl depends on it
    recorded = ["libc6", "engine-watchdog-no-such-package"]
    library = next((name for name in ("libcurl4", "libcurl4t64") if name in installed and "curl" in installed), None)
    if library:
        recorded.append(library)
    names, kept = uninstall.removable({"packages": {"installed": recorded, "requested": ["libc6"]}})
    assert names == []
    assert sorted(kept) == sorted(name for name in recorded if name in installed)
    assert kept["libc6"]
    if library:
        assert kept[library].startswith("needed by ") and "curl" in kept[library]
    assert "already gone: engine-watchdog-no-such-package" in capsys.readouterr().out


def test_the_scripts_are_executable_and_shipped() -> None:
    for script in (INSTALL, UNINSTALL):
        assert script.stat().st_mode & stat.S_IXUSR
    manifest = (REPO / "MANIFEST.in").read_text()
    assert "scripts/install scripts/uninstall" in manifest
    assert "graft deploy" in manifest  # deploy/install/, what the scripts run


def test_the_template_unit_is_the_shipped_unit_with_config_secrets_and_state_per_instance(
        modules: tuple[ModuleType, ModuleType]) -> None:
    hc, _ = modules
    shipped = (REPO / "systemd" / "engine-watchdog.service").read_text()
    made = hc.instance_unit(shipped)
    changed = [(a, b) for a, b in zip(shipped.splitlines(), made.splitlines(), strict=True) if a != b]
    assert [b for _, b in changed] == [
        "Description=engine-watchdog %i: detects frozen vLLM engines",
        "ExecStartPre=/opt/engine-watchdog/.venv/bin/watchdog config check --config /etc/engine-watchdog/%i.toml",
        "ExecStart=/opt/engine-watchdog/.venv/bin/watchdog run --config /etc/engine-watchdog/%i.toml "
        "--state-dir /var/lib/engine-watchdog/%i",
        "StateDirectory=engine-watchdog/%i",
        "EnvironmentFile=-/etc/engine-watchdog/%i.env"], changed  # the hardening and the rest as shipped
    drifted = shipped.replace("StateDirectory=engine-watchdog\n", "StateDirectory=watchdog\n")
    with pytest.raises(ValueError, match=r"0 lines 'StateDirectory=engine-watchdog', not one"):
        hc.instance_unit(drifted)
