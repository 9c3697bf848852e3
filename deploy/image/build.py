#!/usr/bin/env python3
"""Build the engine-watchdog container image with no container registry: a Debian root, the project's wheel,
``docker import``.

    sudo python3 deploy/image/build.py [--root-tar TAR | --root DIR | --suite trixie] [--wheel FILE] [--name NAME]

From a checkout or an unpacked sdist, as root (debootstrap, chroot and unshare need it), with ``docker`` on PATH
(``DOCKER_HOST`` picks the daemon). What it does:

1. **A root**: a tarball of a Debian root (``--root-tar``), a root directory (``--root``, copied, never changed), or
   else ``debootstrap --variant=minbase`` of ``--suite`` (Debian 13: Python 3.13 and a docker CLI of its own),
   kept under ``--cache`` as a tarball for the next run.
2. **The wheel**: ``--wheel FILE``, or ``python -m build --wheel`` of the project beside this file. Its version
   (METADATA) is the image's tag: ``NAME:VERSION``.
3. **Cached**: the inputs' digest (this file, the root tarball, the wheel's contents, constraints.txt) is the image's
   label ``io.engine-watchdog.inputs``. When ``NAME:VERSION`` already carries it, nothing is built.
4. **Inside the root** (chroot, a mount and PID namespace of its own): apt installs the packages the image needs and
   lacks (`PACKAGES`), purges what a host root may hold and a container does not run (`PURGED`), makes the venv at
   ``/opt/engine-watchdog/.venv`` (the path the manifests and runbooks name) and installs the wheel into it offline,
   from wheels this host's pip downloaded for the root's Python and platform (``--find-links DIR``: from there
   only), every version pinned by constraints.txt; then checks ``watchdog --version``, py-spy, docker and pkill.
5. Caches and documentation (not the copyright files) removed, the root tarred and imported with ENTRYPOINT
   ``watchdog``, CMD ``run``, the venv first on PATH.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parents[1]
VENV = "/opt/engine-watchdog/.venv"
STATE_DIR = "/var/lib/engine-watchdog"
STAGE = "/var/tmp/engine-watchdog-build"  # noqa: S108 (inside the root, removed before it is tarred)
PACKAGES = {  # what the image needs beyond a minbase root, and why
    "python3": "the watchdog's interpreter",
    "python3-venv": "the venv at /opt/engine-watchdog/.venv",
    "procps": "pkill: the Kubernetes leader's restart step",
    "docker-cli": "docker restart NAME: restart steps of kind docker, through the mounted socket",
}
PURGED = ("systemd", "libsystemd-shared")  # a host root may hold them; a container runs the watchdog, no init
LABEL = "io.engine-watchdog.inputs"
ENTRYPOINT, CMD = [f"{VENV}/bin/watchdog"], ["run"]
ENV = {"PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
       "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
MIRROR = "http://deb.debian.org/debian"


class BuildError(RuntimeError):
    pass


def run(argv: Sequence[str], timeout: float, what: str, **kw: object) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False,  # type: ignore[call-overload]
                       stdin=subprocess.DEVNULL, **kw)
    if r.returncode != 0:
        raise BuildError(f"{what} failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-1500:]}")
    return str(r.stdout)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_facts(wheel: Path) -> tuple[str, str, str]:
    """(version, commit or "", digest of its members' names and bytes: the same for a rebuild of the same tree)."""
    digest, version, commit = hashlib.sha256(), "", ""
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            data = z.read(name)
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
            if name.endswith(".dist-info/METADATA"):
                version = next((line.split(":", 1)[1].strip() for line in data.decode().splitlines()
                                if line.startswith("Version:")), "")
            elif name == "watchdog/_build_commit.txt":
                commit = data.decode().strip()
    if not version:
        raise BuildError(f"{wheel}: no Version in its METADATA")
    return version, commit, digest.hexdigest()


def build_wheel(out: Path, no_isolation: bool) -> Path:
    if not (PROJECT / "pyproject.toml").exists():
        raise BuildError(f"no pyproject.toml in {PROJECT}: give --wheel FILE")
    argv = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), *(["--no-isolation"] if no_isolation
                                                                             else []), str(PROJECT)]
    run(argv, 600, "python -m build --wheel (pip install build, or give --wheel FILE)")
    [wheel] = out.glob("engine_watchdog-*.whl")
    return wheel


def tar_dir(tree: Path, out: Path) -> None:
    """A tarball of `tree`, entries sorted (the same tree gives the same bytes, so the same cache key)."""
    run(["tar", "--numeric-owner", "--xattrs", "--sort=name", "-C", str(tree), "-cf", str(out), "."], 900,
        f"tar of {tree}")


def debootstrap_tarball(suite: str, mirror: str, cache: Path) -> Path:
    """The minbase root of `suite` with PACKAGES, made once and kept in `cache`."""
    target = cache / f"{suite}-{ARCH}-engine-watchdog-root.tar"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{suite}-") as tmp:
        tree = Path(tmp) / "root"
        run(["debootstrap", "--variant=minbase", f"--arch={ARCH}", f"--include={','.join(PACKAGES)}", suite,
             str(tree), mirror], 1800, f"debootstrap {suite}")
        for cached in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (tree / cached).glob("*"):
                if item.is_file():
                    item.unlink()
        tar_dir(tree, Path(tmp) / "root.tar")
        (Path(tmp) / "root.tar").rename(target)
    return target


# -- inside the root ------------------------------------------------------------------------------------------------

def in_root(root: Path, argv: Sequence[str], timeout: float, what: str) -> str:
    """`argv` as root inside `root`: unshare's mount and PID namespaces (what it mounts and leaves running ends with
    it), then this file's --in-root, which mounts /proc, /dev, /sys, /run, /tmp there and chroots."""
    wrapper = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
               sys.executable, str(Path(__file__).resolve()), "--in-root", str(root), "--"]
    return run([*wrapper, *argv], timeout, what, env=ENV)


def enter(root: str, argv: list[str]) -> int:
    for args in (["-t", "proc", "proc", f"{root}/proc"], ["--rbind", "/dev", f"{root}/dev"],
                 ["--rbind", "/sys", f"{root}/sys"], ["-o", "remount,bind,ro", f"{root}/sys"],
                 ["-t", "tmpfs", "-o", "mode=0755", "tmpfs", f"{root}/run"],
                 ["-t", "tmpfs", "-o", "mode=1777", "tmpfs", f"{root}/tmp"]):  # noqa: S108 (the root's /tmp)
        subprocess.run(["mount", *args], check=True, timeout=30)  # noqa: S607 (util-linux's mount, from PATH)
    os.chroot(root)
    os.chdir("/")
    os.execvp(argv[0], argv)  # noqa: S606 (an argv, run as given)
    return 127  # not reached


def installed(root: Path) -> set[str]:
    out = in_root(root, ["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\n"], 120, "dpkg-query")
    return {line.split("\t")[1] for line in out.splitlines() if line.startswith("ii")}


def root_python(root: Path) -> tuple[str, str, str]:
    """The root's Python (``3.13``), glibc (``2.41``) and machine, for the wheels pip downloads for it."""
    code = "import platform, sys; print('%d.%d' % sys.version_info[:2], platform.libc_ver()[1], platform.machine())"
    version, glibc, machine = in_root(root, ["python3", "-c", code], 60, "the root's python3").split()
    return version, glibc, machine


def download_wheels(wheel: Path, into: Path, root: Path, find_links: Path | None) -> None:
    """This host's pip (its index, proxy and CA settings) fetches every wheel the root's Python will install."""
    version, glibc, machine = root_python(root)
    major, minor = (int(p) for p in glibc.split(".")[:2])
    platforms = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)]
    platforms += [f"manylinux{alias}_{machine}" for alias in ("2014", "2010", "1")]
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--dest", str(into),
            "--only-binary=:all:", "--python-version", version, "--implementation", "cp",
            "--constraint", str(HERE / "constraints.txt"), *(f"--platform={p}" for p in platforms)]
    argv += ["--no-index", "--find-links", str(find_links)] if find_links else []
    run([*argv, str(wheel)], 900, "pip download of the wheels (this python needs pip)")


def assemble(root: Path, wheel: Path, find_links: Path | None) -> list[str]:
    """Packages, venv, wheel, checks, clean-up, in the unpacked `root`; the checks' output lines."""
    shutil.copyfile("/etc/resolv.conf", root / "etc/resolv.conf", follow_symlinks=True)  # apt reaches the mirror
    have = installed(root)
    missing = [p for p in PACKAGES if p not in have]
    if missing:
        in_root(root, ["apt-get", "update", "-q"], 600, "apt-get update")
        in_root(root, ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], 900,
                f"apt-get install {' '.join(missing)}")
    if purged := [p for p in PURGED if p in have]:
        in_root(root, ["apt-get", "purge", "-y", "-q", "--auto-remove", *purged], 600, f"apt-get purge {purged}")
    stage = root / STAGE.lstrip("/")
    (stage / "wheels").mkdir(parents=True)
    shutil.copyfile(wheel, stage / "wheels" / wheel.name)
    download_wheels(wheel, stage / "wheels", root, find_links)
    in_root(root, ["python3", "-m", "venv", VENV], 300, "python3 -m venv")
    shutil.copyfile(HERE / "constraints.txt", stage / "constraints.txt")
    in_root(root, [f"{VENV}/bin/pip", "install", "--no-cache-dir", "--disable-pip-version-check", "--no-index",
                   "--find-links", f"{STAGE}/wheels", "--constraint", f"{STAGE}/constraints.txt",
                   f"{STAGE}/wheels/{wheel.name}"], 600, "pip install of the wheel")
    in_root(root, [f"{VENV}/bin/python", "-m", "pip", "uninstall", "-y", "-q", "pip"], 120, "pip uninstall pip")
    said = [in_root(root, argv, 60, " ".join(argv)).strip().splitlines()[0] for argv in (
        [f"{VENV}/bin/watchdog", "--version"], [f"{VENV}/bin/py-spy", "--version"], ["docker", "--version"],
        ["pkill", "--version"])]
    in_root(root, ["apt-get", "clean"], 120, "apt-get clean")
    shutil.rmtree(stage)
    (root / STATE_DIR.lstrip("/")).mkdir(mode=0o750, parents=True, exist_ok=True)
    (root / "etc/engine-watchdog").mkdir(exist_ok=True)
    (root / "etc/resolv.conf").write_text("")  # docker mounts its own
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/debconf/*-old", "var/lib/dpkg/*-old",
                    "var/log/*.log", "var/log/apt/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*",
                    "usr/share/doc/*/*"):
        for path in root.glob(pattern):
            if path.name == "copyright" and path.parent.parent.name == "doc":
                continue  # the packages' licences stay
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return said


# -- docker ---------------------------------------------------------------------------------------------------------

class Image(NamedTuple):
    id: str
    labels: dict[str, str]
    size: int  # bytes, as docker counts them


def inspect(ref: str) -> Image | None:
    """What the daemon has under `ref`, or None."""
    r = subprocess.run(["docker", "image", "inspect", "--format", "{{json .}}", ref],  # noqa: S607
                       capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        return None
    found = json.loads(r.stdout)
    return Image(str(found.get("Id", "")), dict((found.get("Config") or {}).get("Labels") or {}),
                 int(found.get("Size") or 0))


def docker_import(tar: Path, ref: str, labels: dict[str, str], message: str) -> str:
    changes = [f"ENTRYPOINT {json.dumps(ENTRYPOINT)}", f"CMD {json.dumps(CMD)}", "WORKDIR /", "USER 0",
               "EXPOSE 9830/tcp",
               *(f"ENV {k}={v}" for k, v in ENV.items() if k != "DEBIAN_FRONTEND"),
               *(f"LABEL {k}={json.dumps(v)}" for k, v in sorted(labels.items()))]
    argv = ["docker", "import", "--message", message, *(a for c in changes for a in ("--change", c)), str(tar), ref]
    return run(argv, 900, "docker import").strip()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--in-root"] and len(args) > 3 and args[2] == "--":
        return enter(args[1], args[3:])
    p = argparse.ArgumentParser(prog="deploy/image/build.py", description=__doc__.split("\n\n")[0] if __doc__ else "")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--root-tar", type=Path, help="a tarball of a Debian root (debootstrap minbase, python3)")
    src.add_argument("--root", type=Path, help="a Debian root directory (copied; never changed)")
    src.add_argument("--suite", default="trixie", help="else debootstrap this suite (default trixie, Debian 13)")
    p.add_argument("--mirror", default=MIRROR, help=f"debootstrap's mirror (default {MIRROR})")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "engine-watchdog" / "image",
                   help="where the debootstrapped root is kept (default ~/.cache/engine-watchdog/image)")
    p.add_argument("--wheel", type=Path, help="the engine-watchdog wheel (default: python -m build --wheel here)")
    p.add_argument("--no-isolation", action="store_true", help="python -m build --no-isolation (offline builds)")
    p.add_argument("--find-links", type=Path, help="install only wheels from this directory (no index)")
    p.add_argument("--name", default="engine-watchdog", help="the image's name; tagged NAME:VERSION")
    p.add_argument("--force", action="store_true", help="build even when NAME:VERSION has these inputs")
    a = p.parse_args(args)
    if os.geteuid() != 0:
        print("build.py: run it as root (debootstrap, chroot and unshare need it)", file=sys.stderr)
        return 64
    try:
        return build(a)
    except (BuildError, OSError, subprocess.TimeoutExpired, ValueError) as exc:
        print(f"build.py: {exc}", file=sys.stderr)
        return 1


def build(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="engine-watchdog-image-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        wheel = a.wheel.resolve() if a.wheel else build_wheel(work / "dist", a.no_isolation)
        version, commit, wheel_digest = wheel_facts(wheel)
        if a.root_tar:
            root_tar = a.root_tar.resolve()
        elif a.root:
            root_tar = work / "given-root.tar"
            tar_dir(a.root.resolve(), root_tar)
        else:
            root_tar = debootstrap_tarball(a.suite, a.mirror, a.cache)
        inputs = {"builder": sha256_file(Path(__file__).resolve()), "root": sha256_file(root_tar),
                  "wheel": wheel_digest, "constraints": sha256_file(HERE / "constraints.txt"),
                  "find_links": sorted(p.name for p in a.find_links.glob("*")) if a.find_links else []}
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
        ref = f"{a.name}:{version}"
        before = inspect(ref)
        if not a.force and before is not None and before.labels.get(LABEL) == key:
            print(f"{ref} is up to date (inputs {key[:16]}): nothing built; {before.size / 1e6:.0f} MB")
            return 0
        root = work / "root"
        root.mkdir()
        run(["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-xf", str(root_tar)], 900, f"unpacking {root_tar}")
        said = assemble(root, wheel, a.find_links.resolve() if a.find_links else None)
        image_tar = work / "image.tar"
        tar_dir(root, image_tar)
        labels = {LABEL: key, "org.opencontainers.image.title": "engine-watchdog",
                  "org.opencontainers.image.version": version, "org.opencontainers.image.revision": commit}
        image_id = docker_import(image_tar, ref, labels, f"{said[0]}; built by deploy/image/build.py")
        if before is not None and before.id != image_id:  # the image replaced goes, unless another tag names it
            subprocess.run(["docker", "image", "rm", before.id], capture_output=True, timeout=120,  # noqa: S607
                           check=False, stdin=subprocess.DEVNULL)
        after = inspect(ref)
        print("\n".join(said))
        print(f"{ref} built ({image_id[:19]}, inputs {key[:16]}): {(after.size if after else 0) / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
