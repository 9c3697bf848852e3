"""The production host install (scripts/install runs it with the CPython the venv is made from): docs/install.md.

The venv is made beside the one in use (/opt/engine-watchdog/.venvs/STAMP) and /opt/engine-watchdog/.venv, a link,
is pointed at it only once its `watchdog --version` and `py-spy --version` ran: a failed upgrade leaves the running
install as it was. Config, secrets and state are never replaced.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import host_common as hc
from host_common import Failure, say

SOURCE = Path(__file__).resolve().parents[2]  # the unpacked sdist or git checkout scripts/install lives in
DISTRO_SYSTEMD = Path("/usr/lib/python3/dist-packages/systemd")
MINOR = f"{sys.version_info[0]}.{sys.version_info[1]}"  # of the python running this, the venv's
DOCS = ("README.md", "docs", "runbooks")
UNINSTALLER = ("scripts/uninstall", "deploy/install/find_python.sh", "deploy/install/host_common.py",
               "deploy/install/host_uninstall.py")
ENV_TEMPLATE = """\
# engine-watchdog's secrets: the unit's EnvironmentFile=, read by systemd, never by config.toml. KEY=value lines:
# VLLM_API_KEY=...             when vLLM runs with --api-key (probe.api_key_env)
# WATCHDOG_WEBHOOK_URL=...     an alert sink's url_env
"""


def parse(argv: list[str]) -> argparse.Namespace:
    p = hc.Parser(prog="scripts/install", description="Install engine-watchdog on this host (docs/install.md).")
    p.add_argument("--python", metavar="PATH", help="the CPython >= 3.11 to make the venv with (default python3)")
    p.add_argument("--wheel", metavar="FILE", type=Path, help="install this wheel instead of building this directory")
    p.add_argument("--find-links", metavar="DIR", type=Path, help="offline: wheels from DIR only, no package index")
    p.add_argument("--no-packages", action="store_true", help="install no system package (fail if one is needed)")
    p.add_argument("--list-packages", action="store_true", help="print the system packages it may install, and exit")
    return p.parse_args(argv)


def check_inputs(args: argparse.Namespace) -> None:
    needed = ["systemd/engine-watchdog.service", "systemd/config.example.toml", "README.md"]
    if args.wheel is None:
        needed.append("pyproject.toml")
    for rel in needed:
        if not (SOURCE / rel).is_file():
            raise Failure(f"{SOURCE / rel} is missing: run scripts/install from an unpacked sdist or a git checkout")
    if args.wheel is not None:
        wheel = args.wheel
        if wheel.suffix != ".whl":
            raise Failure(f"--wheel {wheel}: not a wheel (*.whl)")
        try:
            with wheel.open("rb") as f:
                f.read(4)
        except OSError as exc:
            raise Failure(f"--wheel {wheel}: cannot read it: {exc.strerror or exc}") from exc
        args.wheel = wheel.resolve()
    if args.find_links is not None:
        if not args.find_links.is_dir() or not os.access(args.find_links, os.R_OK | os.X_OK):
            raise Failure(f"--find-links {args.find_links}: not a readable directory")
        args.find_links = args.find_links.resolve()


def check_target(record: dict[str, Any] | None) -> None:
    """Refuse an /opt/engine-watchdog the install did not make (a git checkout of the developers' set-up)."""
    if record is None and hc.OPT.is_dir() and any(hc.OPT.iterdir()):
        raise Failure(f"{hc.OPT} holds files no install recorded (no {hc.RECORD.name}): move it away first")
    if hc.VENV_LINK.exists() and not hc.VENV_LINK.is_symlink():
        raise Failure(f"{hc.VENV_LINK} is a directory, not the install's link to its venv: move it away first")


def is_distro_python() -> bool:
    """The venv's base is Debian's python3 (same minor version): the only one python3-* packages serve."""
    distro = Path("/usr/bin/python3")
    if sys.base_prefix != "/usr" or not distro.exists():
        return False
    if distro.resolve() == Path(sys.executable).resolve():
        return True
    r = hc.run([str(distro), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], 30)
    return r.stdout.strip() == MINOR


def system_packages(args: argparse.Namespace, distro: bool) -> None:
    """Install the absent ones among PACKAGES, and record them with every package that became installed."""
    if args.no_packages:
        say("system packages: none (--no-packages)")
        return
    if not hc.has_apt():
        raise Failure("no apt-get here: install python3's venv module yourself and run with --no-packages "
                      "(docs/install.md: other distributions)")
    if not distro:
        say(f"system packages: none ({sys.executable} is not the distro's python3, which they would serve)")
        return
    before = hc.package_states()
    absent = [name for name in hc.PACKAGES if before.get(name) != "ii"]
    if not absent:
        say(f"system packages: {' '.join(hc.PACKAGES)} already installed")
        return
    say(f"system packages: apt-get install --no-install-recommends {' '.join(absent)}")
    argv = ("install", "-y", "--no-install-recommends", *absent)
    r = hc.apt_get(*argv)
    if r.returncode != 0 and any(s in r.stdout for s in ("Unable to locate package", "no installation candidate",
                                                         "is not available", "Failed to fetch")):
        say("  apt has no current package lists: apt-get update")
        update = hc.apt_get("update", timeout=600)
        if update.returncode != 0:
            say(hc.tail(update.stdout))
            raise Failure(f"apt-get update failed (exit {update.returncode}): {hc.last_line(update.stdout)}")
        r = hc.apt_get(*argv)
    added = sorted(name for name in hc.installed_packages() if before.get(name) != "ii")
    # Written at once, so that an install failing later still lets uninstall remove them. Those that had config
    # files left from an earlier removal get them back when removed again; the others are purged.
    record = hc.read_record() or {}
    packages = record.setdefault("packages", {})
    packages["requested"] = hc.merged(packages.get("requested", []), absent)
    packages["installed"] = hc.merged(packages.get("installed", []), added)
    packages["had_config"] = hc.merged(packages.get("had_config", []),
                                       (name for name in added if before.get(name) == "rc"))
    hc.write_record(record)
    if r.returncode != 0:
        say(hc.tail(r.stdout))
        raise Failure(f"apt-get install {' '.join(absent)} failed (exit {r.returncode}): {hc.last_line(r.stdout)}")
    say(f"  added {len(added)}: {' '.join(added)}")


def check_venv_module(args: argparse.Namespace, distro: bool) -> None:
    if importlib.util.find_spec("venv") and importlib.util.find_spec("ensurepip"):
        return
    if distro and hc.has_apt():
        hint = "python3-venv is not installed" + (" (--no-packages)" if args.no_packages else "")
    else:
        hint = f"install its venv module (Debian, Ubuntu: python{MINOR}-venv)"
    raise Failure(f"{sys.executable} cannot make a venv with pip (no ensurepip): {hint}")


def build_venv(args: argparse.Namespace) -> tuple[Path, str]:
    """A new venv under VENVS with the watchdog, py-spy and their dependencies, checked: (its path, --version)."""
    hc.VENVS.mkdir(mode=0o755, parents=True, exist_ok=True)
    venv = hc.VENVS / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    while venv.exists():
        venv = venv.with_name(venv.name + "x")
    try:
        r = hc.run([sys.executable, "-m", "venv", str(venv)], 300)
        if r.returncode != 0:
            raise Failure(f"{sys.executable} -m venv failed (exit {r.returncode}): {hc.last_line(r.stdout)}")
        what = str(args.wheel or SOURCE)
        index = ["--no-index", "--find-links", str(args.find_links)] if args.find_links else []
        say(f"venv: {venv}: pip install {what}" + (f" (wheels from {args.find_links} only)" if index else ""))
        # Dependencies as wheels only (no compiler on the host); the watchdog itself is built from SOURCE.
        r = hc.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                    "--no-cache-dir", "--no-input", "--only-binary=:all:", *index, what], 1800)
        if r.returncode != 0:
            say(hc.tail(r.stdout))
            raise Failure(f"pip install failed (exit {r.returncode}): {hc.last_line(r.stdout)}")
        version = hc.run([str(venv / "bin" / "watchdog"), "--version"], 60)
        if version.returncode != 0 or not version.stdout.startswith("engine-watchdog "):
            raise Failure(f"the new venv's watchdog --version failed: {hc.last_line(version.stdout)}")
        pyspy = hc.run([str(venv / "bin" / "py-spy"), "--version"], 60)
        if pyspy.returncode != 0:
            raise Failure(f"the new venv's py-spy --version failed: {hc.last_line(pyspy.stdout)}")
        say(f"  {version.stdout.strip()}, {pyspy.stdout.strip()}")
        return venv, version.stdout.strip()
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise


def link_systemd_python(venv: Path, distro: bool) -> str:
    """The distro's python3-systemd in the venv, where its compiled modules fit the venv's python."""
    if not distro:
        note = f"skipped: {sys.executable} is not the distro's python3"
    elif not DISTRO_SYSTEMD.is_dir():
        note = f"skipped: no {DISTRO_SYSTEMD} (python3-systemd not installed)"
    else:
        site = venv / "lib" / f"python{MINOR}" / "site-packages" / "systemd"
        site.symlink_to(DISTRO_SYSTEMD)
        r = hc.run([str(venv / "bin" / "python"), "-c", "from systemd import daemon, journal"], 60,
                   env={"PYTHONDONTWRITEBYTECODE": "1"})
        if r.returncode == 0:
            note = f"linked {DISTRO_SYSTEMD}"
        else:
            site.unlink()
            note = f"skipped: the distro's module does not import here: {hc.last_line(r.stdout)}"
    if note.startswith("skipped"):
        note += " (the watchdog sends sd_notify itself and logs to stderr, which the journal keeps)"
    say(f"systemd-python: {note}")
    return note


def precheck_config(venv: Path, running: list[str]) -> None:
    """An upgrade's new version reads each config in place before it replaces the running units: config.toml (unless
    only instances run: then it is no running unit's), and NAME.toml of each running engine-watchdog@NAME."""
    plain = [hc.CONFIG] if not running or hc.UNIT_NAME in running else []
    configs = [*plain, *(hc.ETC / f"{u.removeprefix('engine-watchdog@').removesuffix('.service')}.toml"
                         for u in running if u.startswith("engine-watchdog@"))]
    for config in configs:
        if not config.exists():
            continue
        r = hc.run([str(venv / "bin" / "watchdog"), "config", "check", "--config", str(config)], 120)
        if r.returncode == 0:
            continue
        if running:
            shutil.rmtree(venv, ignore_errors=True)
            raise Failure(f"the new version refuses {config}: {hc.last_line(r.stdout)}; "
                          "the running install is unchanged")
        say(f"warning: the new version refuses {config}: {hc.last_line(r.stdout)}")


def copy_files(created: list[str]) -> None:
    """Docs and the uninstaller under OPT; the unit and its template; config, env and state only where absent."""
    if SOURCE != hc.OPT:
        for name in (*DOCS, *UNINSTALLER):
            src, dst = SOURCE / name, hc.OPT / name
            if dst.is_dir() and not dst.is_symlink():
                shutil.rmtree(dst)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif src.is_file():
                shutil.copy2(src, dst)
        shutil.copy2(SOURCE / "systemd" / "config.example.toml", hc.OPT / "config.example.toml")
    hc.UNIT.parent.mkdir(parents=True, exist_ok=True)
    shipped = (SOURCE / "systemd" / "engine-watchdog.service").read_text()
    for path, text in ((hc.UNIT, shipped), (hc.TEMPLATE, hc.instance_unit(shipped))):
        staged = path.with_name(path.name + ".partial")
        staged.write_text(text)
        staged.chmod(0o644)
        staged.replace(path)
    say(f"unit: {hc.UNIT}; one per engine: {hc.TEMPLATE} (engine-watchdog@NAME: /etc/engine-watchdog/NAME.toml)")
    if not hc.ETC.exists():
        hc.ETC.mkdir(mode=0o755, parents=True)
        created.append(str(hc.ETC))
    if hc.CONFIG.exists():
        say(f"config: {hc.CONFIG} kept")
    else:
        shutil.copyfile(SOURCE / "systemd" / "config.example.toml", hc.CONFIG)
        hc.CONFIG.chmod(0o644)
        created.append(str(hc.CONFIG))
        say(f"config: {hc.CONFIG} (from systemd/config.example.toml)")
    if hc.ENV_FILE.exists():
        say(f"secrets: {hc.ENV_FILE} kept")
    else:
        fd = os.open(hc.ENV_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(ENV_TEMPLATE)
        created.append(str(hc.ENV_FILE))
        say(f"secrets: {hc.ENV_FILE} (0600, the unit's EnvironmentFile)")
    if hc.STATE.exists():
        say(f"state: {hc.STATE} kept")
    else:
        hc.STATE.mkdir(mode=0o750, parents=True)
        hc.STATE.chmod(0o750)
        created.append(str(hc.STATE))
        say(f"state: {hc.STATE} (0750)")


def restart_or_roll_back(venv: Path, old_venv: Path | None, old_units: dict[Path, str | None],
                         running: list[str]) -> str:
    """try-restart the running units (the plain one, each instance) onto the new venv; if one fails to start, all
    back onto the old venv and units, and fail."""
    failed = ""
    for unit in running:
        r = hc.systemctl("try-restart", unit, timeout=300)
        if r is None or r.returncode != 0:
            detail = r.stdout.strip().splitlines()[0] if r is not None and r.stdout.strip() else "no systemctl"
            failed = f"{unit} ({detail})"
            break
    if not failed:
        return f"{', '.join(running)} {'was' if len(running) == 1 else 'were'} running: restarted on the new version"
    if old_venv is None:
        raise Failure(f"systemctl try-restart {failed} failed")
    hc.point_link(old_venv)
    shutil.rmtree(venv, ignore_errors=True)
    for path, text in old_units.items():
        if text is not None:
            path.write_text(text)
        else:
            path.unlink(missing_ok=True)  # the template is new with this version: the old one had none
    hc.daemon_reload()
    back = []
    for unit in running:
        hc.systemctl("reset-failed", unit)  # the failed starts count against the unit's start limit
        r = hc.systemctl("restart", unit, timeout=300)
        back.append(r is not None and r.returncode == 0)
    state = "running the previous version" if all(back) else "not all running"
    raise Failure(f"{failed} did not restart on the new version: back on the previous venv and units, {state}; "
                  f"journalctl -u {failed.split()[0]}")


def install(args: argparse.Namespace) -> int:
    started = time.monotonic()
    record = hc.read_record()
    check_target(record)
    old_venv = hc.VENV_LINK.resolve() if hc.VENV_LINK.is_symlink() and hc.VENV_LINK.exists() else None
    distro = is_distro_python()
    say(f"engine-watchdog install from {args.wheel or SOURCE} with {sys.executable} "
        f"(CPython {'.'.join(map(str, sys.version_info[:3]))})" + (f", upgrading {old_venv}" if old_venv else ""))
    opt_created = not hc.OPT.exists()
    system_packages(args, distro)
    check_venv_module(args, distro)
    try:
        venv, version = build_venv(args)
    except Failure as exc:
        if opt_created and not hc.RECORD.exists():
            shutil.rmtree(hc.OPT, ignore_errors=True)
        left = f"the install in {hc.OPT} is unchanged" if old_venv else "nothing installed"
        if hc.RECORD.exists() and not old_venv:
            left += f" but the system packages (recorded in {hc.RECORD}: scripts/uninstall removes them)"
        raise Failure(f"{exc}; {left}") from exc
    systemd_note = link_systemd_python(venv, distro)
    running = hc.active_units() if old_venv is not None else []
    precheck_config(venv, running)
    old_units = {p: p.read_text() if p.exists() else None for p in (hc.UNIT, hc.TEMPLATE)}
    hc.point_link(venv)
    say(f"venv: {hc.VENV_LINK} -> {venv.relative_to(hc.OPT)}")
    created: list[str] = [str(hc.OPT)] if opt_created else []
    created += [str(p) for p, text in old_units.items() if text is None]
    copy_files(created)
    hc.daemon_reload()
    outcome = restart_or_roll_back(venv, old_venv, old_units, running) if running else "nothing started"
    for stale in hc.VENVS.iterdir():
        if stale != venv:
            shutil.rmtree(stale, ignore_errors=True)
    record = hc.read_record() or {}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    history = [*record.get("history", []), {"at": now, "version": version, "python": sys.executable}]
    record.update({
        "version": version, "installed_at": now, "python": sys.executable,
        "python_version": ".".join(map(str, sys.version_info[:3])), "venv": str(venv.relative_to(hc.OPT)),
        "source": str(args.wheel or SOURCE), "systemd_python": systemd_note,
        "created": hc.merged(record.get("created", []), created), "history": history,
    })
    record.setdefault("packages", {"requested": [], "installed": [], "had_config": []})
    hc.write_record(record)
    say(f"record: {hc.RECORD}")
    verb = "upgraded to" if old_venv else "installed"
    say(f"{verb} {version} in {time.monotonic() - started:.0f} s; {outcome}.")
    say("next:")
    say(f"  edit {hc.CONFIG} (secrets in {hc.ENV_FILE}): {hc.OPT}/README.md, Configure")
    say(f"  {hc.VENV_LINK}/bin/watchdog config check")
    say("  systemctl enable --now engine-watchdog" if not running else "  systemctl status engine-watchdog")
    return 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.list_packages:
        print("\n".join(hc.PACKAGES))
        return 0
    try:
        check_inputs(args)
        hc.require_root()
        os.umask(0o022)
        return install(args)
    except Failure as exc:
        hc.fail(str(exc))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
