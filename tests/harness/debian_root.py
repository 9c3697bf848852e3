"""Clean Debian roots for the install tests and the offline image: made by debootstrap, cached, used by chroot.

A root is `debootstrap --variant=minbase` of a suite (bookworm: Debian 12, Python 3.11; trixie: Debian 13, Python
3.13) for an architecture, with a few packages a user's host has anyway (``python3``, ``systemd``), from the Debian
registry. It is made once per machine and kept as a tarball under the cache (``roots/``, named by suite, arch and the
package list); ``DebianRoot.fresh`` unpacks it into a folder of the test's, so every test starts from the same
untouched root. Building takes a lock, so two processes wanting the same root build it once.

`DebianRoot.run` runs an argv inside the root as root: ``unshare --mount --pid --fork`` (a mount namespace of its
own, so the /proc, /dev, /sys, /run and /tmp mounted for the chroot vanish with it; a PID namespace, so whatever the
command leaves running ends with it), then ``tests.harness.chroot_exec``, which mounts them and chroots. The network
is the host's: pip and apt inside reach PyPI and the Debian registry as the host does. An arm64 root on an x86_64
host needs qemu-user-static with binfmt (`foreign_ok`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tests.harness.engine_env import cache_root

MIRROR = "http://deb.debian.org/debian"
SUITES = {"bookworm": "Debian 12", "trixie": "Debian 13"}
BASE_PACKAGES = ("python3", "systemd")  # on every host the watchdog is for; the install must not need to add them
REPO = Path(__file__).resolve().parents[2]
HOST_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
       "DEBIAN_FRONTEND": "noninteractive"}
# Inside a root, the host's CA bundle (host_ca_env): a network that re-signs TLS (a proxy) is trusted as on the host.
HOST_CA_INSIDE = "/etc/host-ca-certificates.crt"


def roots_dir() -> Path:
    return cache_root() / "roots"


def tarball_name(suite: str, arch: str, packages: Sequence[str]) -> str:
    digest = hashlib.sha256(",".join(sorted(packages)).encode()).hexdigest()[:10]
    return f"{suite}-{arch}-minbase-{digest}.tar"


def foreign_ok(arch: str) -> bool:
    """True when binaries of `arch` run here: the host's own, or a foreign one with qemu's binfmt handler registered."""
    if arch == HOST_ARCH:
        return True
    qemu = {"arm64": "qemu-aarch64", "amd64": "qemu-x86_64"}.get(arch, f"qemu-{arch}")
    return Path("/proc/sys/fs/binfmt_misc", qemu).exists()


def missing_tools(arch: str = HOST_ARCH) -> list[str]:
    """What this machine lacks to make and enter a root (empty when ready): the tests skip with it, naming each."""
    out = [tool for tool in ("debootstrap", "unshare", "tar") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        out.append("root")
    if not foreign_ok(arch):
        out.append(f"binfmt for {arch} (qemu-user-static)")
    return out


def _run(argv: Sequence[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,
                          start_new_session=True, **kwargs)  # type: ignore[call-overload, no-any-return]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def tarball(suite: str, arch: str = HOST_ARCH, extra: Sequence[str] = (), timeout: float = 1200.0) -> Path:
    """The cached root (made now if absent): debootstrap minbase of `suite` with BASE_PACKAGES and `extra`."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: one of {', '.join(SUITES)}")
    packages = [*BASE_PACKAGES, *extra]
    target = roots_dir() / tarball_name(suite, arch, packages)
    with _locked(target):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=roots_dir(), prefix=f".{suite}-") as tmp:
            tree = Path(tmp) / "root"
            argv = ["debootstrap", "--variant=minbase", f"--arch={arch}", f"--include={','.join(packages)}",
                    suite, str(tree), MIRROR]
            r = _run(argv, timeout)
            if r.returncode != 0:
                log = (tree / "debootstrap" / "debootstrap.log")
                detail = log.read_text(errors="replace")[-3000:] if log.exists() else r.stdout[-3000:]
                raise RuntimeError(f"debootstrap {suite}/{arch} failed ({r.returncode}): {r.stderr[-1500:]}\n{detail}")
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):  # what apt fetched: not part of a host
                for item in (tree / cache).glob("*"):
                    if item.is_file():
                        item.unlink()
            partial = target.with_suffix(".partial")
            r = _run(["tar", "--numeric-owner", "--xattrs", "-C", str(tree), "-cf", str(partial), "."], timeout)
            if r.returncode != 0:
                raise RuntimeError(f"tar of the {suite} root failed: {r.stderr[-1500:]}")
            partial.rename(target)
    return target


class DebianRoot:
    """One unpacked root in a folder of the caller's; `run` executes inside it (chroot, own mount and PID spaces)."""

    def __init__(self, path: Path, suite: str, arch: str) -> None:
        self.path, self.suite, self.arch = path, suite, arch

    @classmethod
    def fresh(cls, into: Path, suite: str, arch: str = HOST_ARCH, extra: Sequence[str] = ()) -> DebianRoot:
        tar = tarball(suite, arch, extra)
        into.mkdir(parents=True, exist_ok=True)
        r = _run(["tar", "--numeric-owner", "--xattrs", "-C", str(into), "-xf", str(tar)], 600.0)
        if r.returncode != 0:
            raise RuntimeError(f"unpacking {tar} failed: {r.stderr[-1500:]}")
        shutil.copyfile("/etc/resolv.conf", into / "etc" / "resolv.conf", follow_symlinks=True)
        return cls(into, suite, arch)

    def argv(self, command: Sequence[str], cwd: str = "/root") -> list[str]:
        return ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                sys.executable, "-m", "tests.harness.chroot_exec", str(self.path), cwd, "--", *command]

    def run(self, command: Sequence[str], timeout: float = 600.0, cwd: str = "/root",
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`command` inside the root as root, with a clean environment (ENV, then `env`); never raises on its exit."""
        full_env = {**ENV, **(env or {})}
        return _run(self.argv(command, cwd), timeout, env=full_env, cwd=str(REPO))

    def sh(self, script: str, timeout: float = 600.0, cwd: str = "/root",
           env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A script as a user pastes it into a root shell (the README's steps): /bin/sh -e inside the root."""
        return self.run(["/bin/sh", "-e", "-x", "-c", script], timeout, cwd, env)

    def packages(self) -> set[str]:
        """The names of the installed packages (dpkg's status 'install ok installed')."""
        r = self.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\n"], 120.0)
        if r.returncode != 0:
            raise RuntimeError(f"dpkg-query failed: {r.stderr[-800:]}")
        return {line.split("\t")[1] for line in r.stdout.splitlines() if line.startswith("ii")}

    def host_ca_env(self) -> dict[str, str]:
        """The host's CA bundle copied into the root (HOST_CA_INSIDE), and the variables that make pip, requests and
        Python's ssl trust it: for `run(..., env=)`, so HTTPS (PyPI) inside works wherever it works on the host. The
        root's own trust store is left as it is; {} when the host has no bundle."""
        bundle = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
        if not bundle.is_file():
            return {}
        shutil.copyfile(bundle, self.host_path(HOST_CA_INSIDE))
        return {name: HOST_CA_INSIDE for name in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")}

    def host_path(self, inside: str) -> Path:
        return self.path / inside.lstrip("/")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
