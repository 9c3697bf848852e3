"""What an install leaves in a Debian root, read from the host: the file listing, the allowed package closure, and the
README's Install steps.

The listing is every path under the root with its type, mode, owner and (for a link) target; not the contents, which
apt legitimately rewrites (dpkg's status, ld.so.cache). The paths skipped are those that apt, dpkg and the harness
change whatever the install does, each named with why in SKIPPED.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

# Whole subtrees (the directory itself is still listed, its contents are not).
SKIPPED_TREES = (
    "/proc", "/dev", "/sys", "/run", "/tmp",  # mount points: chroot_exec mounts proc, the host's /dev and /sys, tmpfs
    "/var/cache/apt",  # apt's package cache (pkgcache.bin, the .debs it fetched)
    "/var/lib/apt/lists",  # the indexes `apt-get update` fetched
    "/var/log",  # apt's and dpkg's logs (term.log, history.log, dpkg.log, alternatives.log)
    "/var/cache/debconf",  # debconf's databases, rewritten by every package's configure (with their -old copies)
)
SKIPPED_FILES = (
    "/var/cache/ldconfig/aux-cache",  # ldconfig's own cache, written by the triggers of any library package
    "/etc/resolv.conf",  # DebianRoot.fresh copies the host's in, so the root resolves deb.debian.org and PyPI
    "/var/lib/apt/extended_states",  # apt's auto-installed marks: created by the first install, left empty by a purge
)
DPKG_OLD = re.compile(r"^/var/lib/dpkg/[^/]+-old$")  # dpkg's backups of status, available, diversions


def _skipped(inside: str, also: frozenset[str]) -> bool:
    return inside in SKIPPED_FILES or inside in also or bool(DPKG_OLD.match(inside))


def listing(root: Path, also_skip: Iterable[str] = ()) -> dict[str, str]:
    """Path inside the root -> 'type mode uid:gid[ -> target]', for every entry but the skipped ones.

    `also_skip`: paths inside the root that the test itself put there (the sdists it copied in), with their subtrees.
    """
    also = frozenset(also_skip)
    out: dict[str, str] = {}
    for top, dirs, files in os.walk(root):
        here = "/" + os.path.relpath(top, root).removeprefix(".").lstrip("/")
        base = here.rstrip("/")
        if here in SKIPPED_TREES:
            dirs[:] = []
            continue
        keep = []
        for name in [*dirs, *files]:
            inside = f"{base}/{name}"
            if _skipped(inside, also):
                continue
            st = os.lstat(os.path.join(top, name))
            kind = stat.S_IFMT(st.st_mode)
            entry = f"{_KINDS.get(kind, oct(kind))} {stat.S_IMODE(st.st_mode):04o} {st.st_uid}:{st.st_gid}"
            if stat.S_ISLNK(st.st_mode):
                entry += " -> " + os.readlink(os.path.join(top, name))
            out[inside] = entry
            if name in dirs:
                keep.append(name)
        dirs[:] = [d for d in dirs if d in keep]  # os.walk does not descend into links to directories
    return out


_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "link", stat.S_IFCHR: "char",
          stat.S_IFBLK: "block", stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket"}


def difference(before: Mapping[str, str], after: Mapping[str, str], most: int = 40) -> str:
    """The entries added, removed and changed, a few of each: empty when the listings are equal."""
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
    def show(path: str) -> str:
        return "  =>  ".join(x[path] for x in (before, after) if path in x)

    parts = []
    for label, paths in (("added", added), ("removed", removed), ("changed", changed)):
        if paths:
            lines = [f"{p}  {show(p)}" for p in paths[:most]]
            lines += [f"... and {len(paths) - most} more"] if len(paths) > most else []
            parts.append(f"{len(paths)} {label}:\n  " + "\n  ".join(lines))
    return "\n".join(parts)


def closure(apt_cache_depends: str) -> set[str]:
    """Every package name in `apt-cache depends --recurse ...` output: the packages asked for, each dependency (all
    alternatives of an 'a | b', which is what apt may pick), the virtual names and their providers."""
    names = set()
    for line in apt_cache_depends.splitlines():
        word = line.strip().lstrip("|")
        if ":" in word and word.split(":", 1)[0] in ("Depends", "PreDepends"):
            word = word.split(":", 1)[1].strip()
        word = word.strip("<>").split(":", 1)[0]  # '<debconf-2.0>', 'libc6:arm64'
        if word:
            names.add(word)
    return names


def install_blocks(readme: str) -> list[str]:
    """The fenced `sh` blocks of README's '## Install' section, in order, as written."""
    section = re.search(r"^## Install\n(.*?)(?=^## |\Z)", readme, flags=re.MULTILINE | re.DOTALL)
    if section is None:
        return []
    return re.findall(r"^```sh\n(.*?)^```$", section.group(1), flags=re.MULTILINE | re.DOTALL)


def fingerprint(path: Path) -> tuple[bytes, str]:
    """A file's bytes and its mode and owner, to tell whether an upgrade kept it."""
    st = path.stat()
    return path.read_bytes(), f"{stat.S_IMODE(st.st_mode):04o} {st.st_uid}:{st.st_gid}"
