"""The install as an operator does it, in clean Debian roots (tests/harness/debian_root.py): Debian 12 (Python 3.11)
and Debian 13 (Python 3.13), amd64 and, under qemu-user-static, arm64.

Per root: README's Install steps verbatim from the release's sdist; the installed watchdog's --version, replay of a
recorded trace, explain of recorded dumps and check of a recorded /metrics page; the packages it added are what
`./scripts/install --list-packages` declares and their dependencies; an upgrade from a higher version's sdist keeps
config, secrets and state; uninstall keeps config and state, --purge leaves the root as it was (packages and files).

arm64 runs where binfmt for qemu-aarch64 is registered (`debian_root.foreign_ok`), or is asked for with
WATCHDOG_TEST_ARM64=1 (then a missing binfmt is a failure, not a skip); WATCHDOG_TEST_ARM64=0 skips it. py-spy's
attach is not run anywhere here (`watchdog dump`): under emulation it is not expected to work.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import debian_root
from tests.harness.debian_root import HOST_CA_INSIDE, DebianRoot
from tests.install.conftest import CHECKOUT, Release
from tests.install.footprint import closure, difference, fingerprint, install_blocks, listing

DATA = CHECKOUT / "tests" / "data"
TRACE = DATA / "livelock" / "livelock.trace.jsonl"  # `watchdog record` of a real vLLM 0.32 in a livelock
DUMPS = sorted((DATA / "hangs" / "diverged-0.25.1" / "dumps").glob("round1-*-VLLM-*.json"))  # real diverged ranks
VENV_WATCHDOG = "/opt/engine-watchdog/.venv/bin/watchdog"
CONFIG = "/etc/engine-watchdog/config.toml"
KEPT = (CONFIG, "/etc/engine-watchdog/env", "/var/lib/engine-watchdog/events.jsonl")
TEST_DATA = "/root/install-test-data"  # the recorded trace and dumps, copied in by the test
NO_BOOT_SYSTEMCTL = CHECKOUT / "tests" / "data" / "install" / "systemctl"  # README's `enable --now`, without systemd
# packages of the test suite and of a build: the host install never adds one
FORBIDDEN = re.compile(r"^(haproxy|nginx.*|prometheus.*|openssh-server|docker.*|containerd.*|gcc.*|cpp.*|"
                       r"python3(\.\d+)?-dev|libpython3.*-dev|build-essential)$")

CASES = [pytest.param(suite, arch, id=f"{suite}-{arch}", marks=[pytest.mark.timeout(7200 if arch == "arm64" else 1800)])
         for arch in ("amd64", "arm64") for suite in ("bookworm", "trixie")]


def _skip_reason(arch: str) -> str | None:
    """Why this machine cannot run the case (None: it runs); a foreign arch asked for and not runnable fails."""
    foreign, wanted = arch != debian_root.HOST_ARCH, os.environ.get("WATCHDOG_TEST_ARM64", "")
    if foreign and wanted == "0":
        return f"{arch}: WATCHDOG_TEST_ARM64=0"
    missing = debian_root.missing_tools(arch)
    if missing and foreign and wanted == "1":
        pytest.fail(f"WATCHDOG_TEST_ARM64=1 but this machine lacks: {', '.join(missing)} "
                    "(binfmt: apt-get install qemu-user-static binfmt-support)")
    if missing and foreign:
        return (f"needs {', '.join(missing)}: apt-get install qemu-user-static binfmt-support, or "
                "WATCHDOG_TEST_ARM64=1 to make it a failure")
    return "needs " + ", ".join(missing) if missing else None


@pytest.fixture
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DebianRoot]:
    suite, arch = request.node.callspec.params["suite"], request.node.callspec.params["arch"]
    reason = _skip_reason(arch)
    if reason:
        pytest.skip(reason)
    made = DebianRoot.fresh(tmp_path / "root", suite, arch)
    yield made
    made.remove()  # a few hundred MB each


def ok(r: subprocess.CompletedProcess[str], what: str) -> str:
    """stdout of a finished command that must have exited 0; else a failure naming it with its output."""
    if r.returncode != 0:
        pytest.fail(f"{what}: exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}")
    return r.stdout


def _edit_config(root: DebianRoot) -> None:
    """The operator's edit between README's blocks: a shorter stall window (the replay and check below rely on it)."""
    path = root.host_path(CONFIG)
    text, n = re.subn(r"^stall_window = [0-9.]+", "stall_window = 15.0", path.read_text(), count=1,
                      flags=re.MULTILINE)
    assert n == 1, f"{CONFIG} as installed has no stall_window line to edit"
    path.write_text(text)


def _check_commands(root: DebianRoot, release: Release, page_url: str) -> None:
    out = ok(root.run([VENV_WATCHDOG, "--version"]), "watchdog --version")
    assert out.strip() == f"engine-watchdog {release.version} (commit {release.commit})"

    # the recorded livelock under the edited config (suspect at 5 s, frozen at 15 s), as tests/unit replays it
    out = ok(root.run([VENV_WATCHDOG, "replay", f"{TEST_DATA}/{TRACE.name}"]), "watchdog replay")
    moves = [json.loads(line) for line in out.splitlines()]
    assert [m["to"] for m in moves] == ["starting", "idle", "working", "suspect", "frozen"], out
    assert "running=2" in moves[-1]["reason"], out

    out = ok(root.run([VENV_WATCHDOG, "explain", *(f"{TEST_DATA}/{d.name}" for d in DUMPS)]), "watchdog explain")
    assert re.search(r"^worker\[29712\]\s+worker\s+in_collective\s", out, flags=re.MULTILINE), out
    assert re.search(r"^worker\[29713\]\s+worker\s+in_collective\s+barrier", out, flags=re.MULTILINE), out
    assert "culprit: none named: every rank seen is inside different collectives" in out, out
    assert "the ranks diverged" in out, out

    r = root.run([VENV_WATCHDOG, "check", "--url", page_url, "--seconds", "20"], timeout=120)
    assert r.returncode == 1, f"check of a page that never moves: exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert re.search(r"^engine 0: FROZEN: no progress for \d+s with work pending \(running=4 waiting=0\)",
                     r.stdout, flags=re.MULTILINE), r.stdout


def _allowed(root: DebianRoot, source: str) -> tuple[list[str], set[str]]:
    """What `scripts/install --list-packages` declares, and those packages with their dependencies (apt's view)."""
    declared = ok(root.run(["./scripts/install", "--list-packages"], cwd=source), "install --list-packages").split()
    if not declared:
        return [], set()
    argv = ["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
            "--no-replaces", "--no-enhances", *declared]
    r = root.run(argv, timeout=300)
    if r.returncode != 0:  # the install left no package lists behind: fetch them (the listing skips them)
        ok(root.run(["apt-get", "update", "-qq"], timeout=300), "apt-get update")
        r = root.run(argv, timeout=300)
    return declared, closure(ok(r, "apt-cache depends"))


def _copy_in(root: DebianRoot, release: Release) -> str:
    shutil.copy2(release.sdist, root.host_path(f"/root/{release.sdist.name}"))
    return f"/root/{release.sdist.name.removesuffix('.tar.gz')}"


def _readme_steps(release: Release) -> list[str]:
    """README's Install blocks, checked to unpack the sdist the build makes (pyproject's version)."""
    blocks = install_blocks((CHECKOUT / "README.md").read_text())
    assert blocks, "README.md's ## Install has no ```sh block"
    named = re.search(r"tar -xzf (engine_watchdog-(\S+)\.tar\.gz) && cd (\S+)", blocks[0])
    assert named, f"README's first Install block unpacks no sdist:\n{blocks[0]}"
    assert named.group(1) == release.sdist.name and named.group(2) == release.version, \
        f"README installs {named.group(1)}; the build makes {release.sdist.name} (pyproject: {release.version})"
    assert named.group(3) == f"engine_watchdog-{release.version}", named.group(0)
    return blocks


@pytest.mark.install
@pytest.mark.parametrize(("suite", "arch"), CASES)
def test_install_upgrade_uninstall_as_an_operator(root: DebianRoot, suite: str, arch: str, release: Release,
                                                  next_release: Release, recorded_page: str) -> None:
    where, times, began = f"{suite}/{arch}", {}, time.monotonic()
    blocks = _readme_steps(release)
    ours = [f"/root/{r.sdist.name}" for r in (release, next_release)]
    ours += [name.removesuffix(".tar.gz") for name in ours] + [TEST_DATA, HOST_CA_INSIDE]  # the test's own files
    # HTTPS to PyPI trusted as on the host (a proxy's CA; the harness's file, skipped). No systemd runs in the root,
    # and its PID 1 is the command's own (a PID namespace), so systemctl sees no chroot: SYSTEMD_OFFLINE has it act on
    # the unit files only, as in one (daemon-reload, try-restart, start: nothing to do, exit 0).
    env = {**root.host_ca_env(), "SYSTEMD_OFFLINE": "1"}

    def step(argv: list[str], cwd: str, what: str) -> str:
        return ok(root.run(argv, timeout=1200, cwd=cwd, env=env), f"{where}: {what}")

    pristine_packages, pristine_files = root.packages(), listing(root.path, ours)

    data = root.host_path(TEST_DATA)
    (data / "bin").mkdir(parents=True)
    for f in (TRACE, *DUMPS):
        shutil.copy2(f, data / f.name)
    shutil.copy2(NO_BOOT_SYSTEMCTL, data / "bin" / "systemctl")

    # --- README's steps, verbatim, as root in /root; the operator's config edit after the block that installs
    source = _copy_in(root, release)
    # `systemctl enable --now` fails without a running systemd, chroot or not: NO_BOOT_SYSTEMCTL drops the --now
    readme_env = {**env, "PATH": f"{TEST_DATA}/bin:{debian_root.ENV['PATH']}"}
    for block in blocks:
        ok(root.sh(block, timeout=1200, env=readme_env), f"{where}: README's Install block\n{block}")
        if "./scripts/install" in block:
            _edit_config(root)
    assert step(["systemctl", "is-enabled", "engine-watchdog"], "/root", "is-enabled").strip() == "enabled"
    times["install"] = time.monotonic()
    _check_commands(root, release, recorded_page)
    times["commands"] = time.monotonic()

    # --- packages: nothing beyond the declared ones and their dependencies; none of the test suite's, no compiler
    added = root.packages() - pristine_packages
    declared, allowed = _allowed(root, source)
    assert not {p for p in added if FORBIDDEN.match(p)}, f"{where}: the install added {sorted(added)}"
    assert added <= allowed, (f"{where}: added beyond --list-packages {declared} and their dependencies: "
                              f"{sorted(added - allowed)}")

    # --- upgrade in place from the higher version's sdist: config, secret and state kept, byte for byte
    with root.host_path("/etc/engine-watchdog/env").open("a") as secrets:
        secrets.write("VLLM_API_KEY=sk-install-test-secret\n")
    root.host_path("/var/lib/engine-watchdog/events.jsonl").write_text('{"kind": "transition", "to": "idle"}\n')
    kept = {p: fingerprint(root.host_path(p)) for p in KEPT}
    next_source = _copy_in(root, next_release)
    step(["tar", "-xzf", next_release.sdist.name], "/root", "unpacking the next sdist")
    step(["./scripts/install"], next_source, "./scripts/install (the upgrade)")
    out = step([VENV_WATCHDOG, "--version"], "/root", "watchdog --version after the upgrade")
    assert out.strip() == f"engine-watchdog {next_release.version} (commit {next_release.commit})"
    for p, before in kept.items():
        assert fingerprint(root.host_path(p)) == before, f"{where}: the upgrade changed {p}"
    times["upgrade"] = time.monotonic()

    # --- uninstall keeps config and state; --purge leaves the root as it was
    step(["./scripts/uninstall"], next_source, "./scripts/uninstall")
    for p, before in kept.items():
        assert root.host_path(p).exists(), f"{where}: the plain uninstall removed {p}"
        assert fingerprint(root.host_path(p)) == before, f"{where}: the plain uninstall changed {p}"
    for gone in ("/opt/engine-watchdog", "/etc/systemd/system/engine-watchdog.service",
                 "/etc/systemd/system/engine-watchdog@.service",
                 "/etc/systemd/system/multi-user.target.wants/engine-watchdog.service"):
        assert not os.path.lexists(root.host_path(gone)), f"{where}: uninstall left {gone}"
    now = root.packages()
    assert now == pristine_packages, (f"{where}: after uninstall, packages added {sorted(now - pristine_packages)}, "
                                      f"removed {sorted(pristine_packages - now)}")
    step(["./scripts/uninstall", "--purge"], next_source, "./scripts/uninstall --purge")
    assert root.packages() == pristine_packages
    left = difference(pristine_files, listing(root.path, ours))
    assert not left, f"{where}: after uninstall --purge the root differs from the pristine one:\n{left}"
    times["uninstall"] = time.monotonic()
    spans = [f"{name} {end - began:.0f} s" for name, end in times.items()]
    print(f"\n{where}: cumulative " + ", ".join(spans) + f"; packages added and removed: {' '.join(sorted(added))}")
