"""README's `systemctl enable --now engine-watchdog`, for real: the installed service started by the Debian root's own
systemd (tests/harness/systemd_ns.py with ``root=``: PID 1 of namespaces of its own, pivoted into the unpacked root).

Per suite (Debian 12 and 13, the machine's architecture): README's first Install block in the plain chroot (its network
is the host's: apt and PyPI), and the next release's wheel with its dependencies fetched there for the upgrade. Then
the root boots (loopback only) and README's second block runs verbatim with the root's real systemctl. The service
must run as installed: active (Type=notify: READY=1 came), its main process the venv's `watchdog run`, sd_notify and
the journal through the distro's python3-systemd linked in the venv, inside the unit's sandbox (a read-only /, the
state directory writable: it writes status.json), and `watchdog status` says the engine at 127.0.0.1:8000, where
nothing listens, is down. An offline upgrade (`--wheel` and `--find-links`, as docs/install.md says) restarts it on
the new venv; `./scripts/uninstall` stops and disables it and removes the unit.

The one change to the unit is the harness's drop-in (DefaultDependencies=no, Conflicts=/Before=shutdown.target): the
throwaway systemd never reaches sysinit.target or basic.target, which are masked with every unit of the root's own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import debian_root, systemd_ns
from tests.harness.debian_root import DebianRoot
from tests.harness.shipped_unit import wait_for
from tests.harness.systemd_ns import ThrowawaySystemd
from tests.install.conftest import CHECKOUT, Release
from tests.install.footprint import install_blocks

UNIT = "engine-watchdog.service"
VENV = "/opt/engine-watchdog/.venv"
WATCHDOG = f"{VENV}/bin/watchdog"
CONFIG = "/etc/engine-watchdog/config.toml"
STATUS = "/var/lib/engine-watchdog/status.json"
UNIT_FILE = f"/etc/systemd/system/{UNIT}"
WANTS_LINK = f"/etc/systemd/system/multi-user.target.wants/{UNIT}"
DISTRO_SYSTEMD = "/usr/lib/python3/dist-packages/systemd"
WHEELS = "/root/wheels"  # the next release's wheel and its dependencies, for the offline upgrade
HARNESS_DROP_IN = f"/run/systemd/system/{UNIT}.d/00-throwaway.conf"
TEMPLATE = "engine-watchdog@.service"  # one watchdog per engine: instance "b" beside the plain unit
INSTANCE = "engine-watchdog@b.service"
INSTANCE_CONFIG = '[engine]\nurl = "http://127.0.0.1:8001"\nname = "vllm-b"\n[exporter]\nport = 9831\n'
INSIDE_ENV = [f"{k}={v}" for k, v in debian_root.ENV.items()]  # a root shell's, as in the plain chroot

def ok(r: subprocess.CompletedProcess[str], what: str) -> str:
    if r.returncode != 0:
        pytest.fail(f"{what}: exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}")
    return r.stdout


def inside(sd: ThrowawaySystemd, argv: list[str], cwd: str = "/root",
           timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`argv` in the booted root as its root shell runs it: a clean environment, in `cwd`."""
    return sd.run(["env", "-i", "-C", cwd, *INSIDE_ENV, *argv], timeout=timeout)


def show(sd: ThrowawaySystemd, *props: str) -> dict[str, str]:
    out = sd.systemctl("show", UNIT, *(f"--property={p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def main_process(sd: ThrowawaySystemd) -> tuple[int, list[str]]:
    """The unit's MainPID (inside) and its command line."""
    pid = sd.main_pid(UNIT)
    assert pid > 0, sd.status(UNIT, 20)
    return pid, sd.read_file(f"/proc/{pid}/cmdline").rstrip("\0").split("\0")


def venv_in_use(sd: ThrowawaySystemd) -> str:
    return ok(sd.run(["readlink", "-f", VENV]), "readlink -f the venv link").strip()


def status_json(root: DebianRoot, pid: int) -> dict[str, object] | None:
    """status.json (the root's own file, read from the host) once the daemon of `pid` wrote it."""
    try:
        status = json.loads(root.host_path(STATUS).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return status if status.get("pid") == pid else None


def check_running_as_installed(sd: ThrowawaySystemd, root: DebianRoot, version: str) -> tuple[int, str]:
    """The service runs the venv in use, notified and logged through python3-systemd, sandboxed; (pid, venv)."""
    assert sd.systemctl("is-active", UNIT, check=False).stdout.strip() == "active", sd.status(UNIT, 30)
    props = show(sd, "Type", "SubState", "NRestarts", "FragmentPath", "DropInPaths", "StatusText", "ProtectSystem")
    assert props["Type"] == "notify" and props["SubState"] == "running" and props["NRestarts"] == "0", props
    assert props["FragmentPath"] == UNIT_FILE and props["DropInPaths"] == HARNESS_DROP_IN, props
    assert props["ProtectSystem"] == "strict" and props["StatusText"], props  # STATUS= came with READY=1
    pid, argv = main_process(sd)
    venv = venv_in_use(sd)
    assert argv == [f"{venv}/bin/python", WATCHDOG, "run", "--config", CONFIG], argv
    assert ok(inside(sd, [WATCHDOG, "--version"]), "watchdog --version").strip() == version
    # sd_notify went through systemd.daemon: the distro's compiled module and libsystemd are in the process
    maps = sd.read_file(f"/proc/{pid}/maps")
    assert re.search(rf" {re.escape(DISTRO_SYSTEMD)}/_daemon\.cpython-\S+\.so$", maps, re.MULTILINE), maps[-3000:]
    assert re.search(r"/libsystemd\.so\.0[.\d]*$", maps, re.MULTILINE), maps[-3000:]
    assert f" {venv}/lib/python" in maps  # the venv's own compiled packages (psutil's)
    # ... and the log through its JournalHandler: native journal entries with the logger's fields
    journal = sd.run(["journalctl", "--no-pager", "-o", "json", f"_PID={pid}"]).stdout
    entries = [json.loads(line) for line in journal.splitlines()]
    native = [e for e in entries if e.get("_TRANSPORT") == "journal" and "LOGGER" in e]
    assert native and all(e.get("SYSLOG_IDENTIFIER") == "engine-watchdog" for e in native), journal[-3000:]
    # the sandbox: / read-only, the state directory writable, no new privileges
    mounts = {f[4]: f[5] for f in (line.split() for line in sd.read_file(f"/proc/{pid}/mountinfo").splitlines())}
    assert mounts["/"].split(",")[0] == "ro" and mounts["/var/lib/engine-watchdog"].split(",")[0] == "rw", mounts
    assert "NoNewPrivs:\t1" in sd.read_file(f"/proc/{pid}/status")
    wait_for(f"{STATUS} written by pid {pid}", 60, lambda: status_json(root, pid), every=0.5)
    return pid, venv


def check_instance(sd: ThrowawaySystemd, root: DebianRoot) -> None:
    """engine-watchdog@b runs the installed template: config b.toml, state /var/lib/engine-watchdog/b, the same
    sandbox as the plain unit, its own status saying its own stack down."""
    assert sd.systemctl("is-active", INSTANCE, check=False).stdout.strip() == "active", sd.status(INSTANCE, 30)
    out = sd.systemctl("show", INSTANCE, "--property=FragmentPath", "--property=ProtectSystem",
                       "--property=Type").stdout
    assert f"FragmentPath=/etc/systemd/system/{TEMPLATE}" in out and "ProtectSystem=strict" in out, out
    pid = int(sd.systemctl("show", INSTANCE, "--property=MainPID", "--value").stdout.strip())
    argv = sd.read_file(f"/proc/{pid}/cmdline").split("\0")[1:-1]
    assert argv == [WATCHDOG, "run", "--config", "/etc/engine-watchdog/b.toml", "--state-dir",
                    "/var/lib/engine-watchdog/b"], argv

    def says_b_down() -> str | None:
        r = inside(sd, [WATCHDOG, "status", "--state-dir", "/var/lib/engine-watchdog/b"], timeout=60)
        return r.stdout if r.returncode == 0 and "stack vllm-b at http://127.0.0.1:8001" in r.stdout else None

    wait_for("`watchdog status` of instance b", 60, says_b_down, every=0.5)
    assert root.host_path("/var/lib/engine-watchdog/b/status.json").exists()


def check_status_says_down(sd: ThrowawaySystemd, pid: int) -> str:
    """`watchdog status`, as the operator types it: the daemon running, the engine (nothing on :8000) down."""
    last: list[subprocess.CompletedProcess[str]] = []

    def down() -> str | None:
        last[:] = [inside(sd, [WATCHDOG, "status"], timeout=60)]
        out = last[0].stdout
        return out if last[0].returncode == 0 and re.search(r"^  engine \S+: down ", out, re.MULTILINE) else None

    try:
        out = wait_for("`watchdog status` saying the engine is down", 60, down, every=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last (exit {last[0].returncode}):\n{last[0].stdout}{last[0].stderr}") from None
    assert re.match(rf"daemon: running \(pid {pid}, last pass \d+s ago\), stack vllm at http://127\.0\.0\.1:8000\n",
                    out), out
    engines = re.findall(r"^  engine .*$", out, re.MULTILINE)
    assert len(engines) == 1 and re.fullmatch(r"  engine server: down for \d+s: nothing listening at "
                                              r"http://127\.0\.0\.1:8000/metrics/? \(connection refused\)",
                                              engines[0]), out
    # a down incident opens once the outage lasts; nothing restarts (no restart is configured)
    assert re.search(r"^incident(: none open| \S+-down-\S+: down, observing, 0 restart\(s\))", out, re.MULTILINE), out
    assert "\nrestart: not configured; budget: 3 of 3 left; paused: no; gave up: no\n" in out, out
    return out


@pytest.fixture
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DebianRoot]:
    missing = debian_root.missing_tools()
    if missing:
        pytest.skip("needs " + ", ".join(missing))
    made = DebianRoot.fresh(tmp_path / "root", request.node.callspec.params["suite"])
    yield made
    made.remove()


@pytest.mark.install
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("suite", ["bookworm", "trixie"])
def test_readme_enable_now_starts_the_installed_service(root: DebianRoot, suite: str, release: Release,
                                                         next_release: Release, tmp_path: Path) -> None:
    began, times = time.monotonic(), {}
    blocks = install_blocks((CHECKOUT / "README.md").read_text())
    assert len(blocks) == 2 and "./scripts/install" in blocks[0], blocks
    assert "systemctl enable --now engine-watchdog" in blocks[1], blocks[1]
    env = root.host_ca_env()

    # --- in the plain chroot (the host's network): README's first block, and the upgrade's wheels
    shutil.copy2(release.sdist, root.host_path(f"/root/{release.sdist.name}"))
    ok(root.sh(blocks[0], timeout=1200, env=env), f"{suite}: README's first Install block\n{blocks[0]}")
    source = f"/root/{release.sdist.name.removesuffix('.tar.gz')}"
    next_source = f"/root/{next_release.sdist.name.removesuffix('.tar.gz')}"
    shutil.copy2(next_release.sdist, root.host_path(f"/root/{next_release.sdist.name}"))
    pip = [f"{VENV}/bin/python", "-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]
    fetch = (f"tar -xzf {next_release.sdist.name}\n"
             f"{' '.join(pip)} wheel --no-deps -w {WHEELS} {next_source}\n"
             f"{' '.join(pip)} download --only-binary=:all: -d {WHEELS} {WHEELS}/engine_watchdog-*.whl\n")
    ok(root.sh(fetch, timeout=1200, env=env), f"{suite}: the next release's wheels")
    [wheel] = root.host_path(WHEELS).glob("engine_watchdog-*.whl")
    times["install"] = time.monotonic()

    reason = systemd_ns.available(root.path)
    assert reason is None, reason
    root.host_path("/etc/engine-watchdog/b.toml").write_text(INSTANCE_CONFIG)
    with ThrowawaySystemd(f"booted-{suite}", {}, root=root.path, root_units=[UNIT, TEMPLATE],
                          log_dir=tmp_path / "sd") as sd:
        times["boot"] = time.monotonic()
        assert ok(sd.run(["cat", "/etc/debian_version"]), "the booted root") == \
            root.host_path("/etc/debian_version").read_text()
        assert sd.run(["test", "-e", str(CHECKOUT / "pyproject.toml")]).returncode == 1  # the machine's tree is gone
        # --- README's second block, verbatim, with the root's real systemctl
        ok(inside(sd, ["/bin/sh", "-e", "-x", "-c", blocks[1]]), f"{suite}: README's second Install block")
        assert sd.systemctl("is-enabled", UNIT, check=False).stdout.strip() == "enabled"
        assert root.host_path(UNIT_FILE).read_bytes() == root.host_path(f"{source}/systemd/{UNIT}").read_bytes()
        version = f"engine-watchdog {release.version} (commit {release.commit})"
        pid, venv = check_running_as_installed(sd, root, version)
        [site] = root.host_path(venv).glob("lib/python3*/site-packages")
        assert (site / "systemd").is_symlink() and str((site / "systemd").readlink()) == DISTRO_SYSTEMD
        said = check_status_says_down(sd, pid)
        # a second engine's watchdog: the template the install made, its own config, state and exporter port
        ok(inside(sd, ["systemctl", "enable", "--now", INSTANCE]), f"{suite}: systemctl enable --now {INSTANCE}")
        check_instance(sd, root)
        # nothing else of the root's runs: its units are masked, but for the journal
        running = sd.systemctl("list-units", "--type=service", "--state=running", "--plain", "--no-legend").stdout
        assert sorted(line.split()[0] for line in running.splitlines()) == [UNIT, INSTANCE,
                                                                           "systemd-journald.service"], running
        times["started"] = time.monotonic()

        # --- upgrade while it runs, offline (the namespace has loopback only): restarted on the new venv
        upgrade = [f"{next_source}/scripts/install", "--wheel", f"{WHEELS}/{wheel.name}", "--find-links", WHEELS]
        out = ok(inside(sd, upgrade, cwd=next_source), f"{suite}: the upgrade")
        assert f"{UNIT}, {INSTANCE} were running: restarted on the new version" in out, out
        next_version = f"engine-watchdog {next_release.version} (commit {next_release.commit})"
        new_pid, new_venv = check_running_as_installed(sd, root, next_version)
        assert new_pid != pid and new_venv != venv, (pid, venv, new_pid, new_venv)
        assert not root.host_path(venv).exists(), f"the upgrade left the previous venv {venv}"
        check_status_says_down(sd, new_pid)
        check_instance(sd, root)
        times["upgrade"] = time.monotonic()

        # --- uninstall: stopped, disabled, the unit gone
        out = ok(inside(sd, ["./scripts/uninstall"], cwd=next_source), f"{suite}: ./scripts/uninstall")
        assert f"systemd: {UNIT} stopped and disabled" in out, out
        assert f"systemd: {INSTANCE} stopped and disabled" in out, out
        assert show(sd, "LoadState", "ActiveState") == {"LoadState": "not-found", "ActiveState": "inactive"}
        assert sd.systemctl("is-enabled", UNIT, check=False).returncode != 0
        for gone in (UNIT_FILE, WANTS_LINK, "/opt/engine-watchdog", f"/etc/systemd/system/{TEMPLATE}",
                     f"/etc/systemd/system/multi-user.target.wants/{INSTANCE}"):
            assert not root.host_path(gone).exists() and not root.host_path(gone).is_symlink(), gone
        assert sd.run(["test", "-e", f"/proc/{new_pid}"]).returncode == 1, f"pid {new_pid} still runs"
        assert sd.cgroup_dir is not None and not (sd.cgroup_dir / "system.slice" / UNIT).exists()
        times["uninstall"] = time.monotonic()
    spans = [f"{name} {end - began:.0f} s" for name, end in times.items()]
    print(f"\n{suite}: cumulative " + ", ".join(spans) + f"; boot {sd.boot_seconds:.2f} s; status said:\n{said}")
