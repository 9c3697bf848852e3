"""Files that someone else may control, opened as root without being fooled: the engine's log (its user writes
it and its directory), a Flight Recorder dump and its trigger pipe (their paths come from the engine's own
environment).

Every component of the path is opened from the one before it with ``O_NOFOLLOW`` (a symbolic link anywhere on the
path is refused: a link to ``/etc/shadow``, or a directory swapped for one, cannot redirect us), the last one with
``O_NONBLOCK`` (a FIFO cannot hang the open); its type is checked before the open (``lstat``) and again on what was
opened (``fstat``, the same inode): a regular file to read, a FIFO to write. A file with more than one hard link is
refused (the other name may be a file its writer could not read), and ``owners`` (uids) limits who may own it.
Reads are capped: `read_tail` reads at most the last ``max_bytes``, `read_capped` refuses a file over its cap, so
``/dev/zero`` or a file that grows while read cannot exhaust memory.

``root``: a path named by a process in another mount namespace (a container) is opened under that process's root,
``/proc/PID/root`` (`watchdog.host.ns_paths` says when). The walk then starts from an fd of that directory and never
leaves it: ``..`` is taken lexically (never opened: from the container's root the kernel would step up into the
host), and a symbolic link on the directories of the path is resolved inside that root, like ``openat2``'s
``RESOLVE_IN_ROOT`` (a link to ``/etc`` reaches the container's ``/etc``, never the host's); the last component is
still never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Collection, Iterator

from watchdog.host.ns_paths import host_path as shown

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ROOT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # /proc/PID/root is a link to follow: it is the root
_MAX_LINKS = 40  # as the kernel's
_LAST = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class UnsafeFile(OSError):
    """A file refused for what it is (a link, a FIFO, a device, another owner...); ``str`` says what."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.strerror = why  # what `log_tail` and the like print after the path
        self.filename = path

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _walk_in_root(root: str, parts: list[str], path: str) -> int:
    """An fd of the directory ``parts`` name under ``root``, symbolic links resolved inside ``root``."""
    stack = [os.open(root, _ROOT)]
    todo, links = list(parts), 0
    try:
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            if part == "..":  # lexical, clamped at the root
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            try:
                stack.append(os.open(part, _DIR, dir_fd=stack[-1]))
                continue
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                if not stat.S_ISLNK(os.stat(part, dir_fd=stack[-1], follow_symlinks=False).st_mode):
                    raise UnsafeFile(path, f"{part!r} on its path is not a directory") from None
                target = os.readlink(part, dir_fd=stack[-1])
            links += 1
            if links > _MAX_LINKS:
                raise UnsafeFile(path, "too many symbolic links on its path (refused)")
            if target.startswith("/"):  # absolute: from the root we were given, not the host's
                while len(stack) > 1:
                    os.close(stack.pop())
            todo = [t for t in target.split("/") if t] + todo
        fd = stack.pop()
        return fd
    finally:
        for f in stack:
            os.close(f)


@contextlib.contextmanager
def _parent(path: str, root: str | None = None) -> Iterator[tuple[int, str]]:
    """(an fd of the directory holding the path's last component, that component), every directory on the way
    opened without following a link (under ``root``: resolving links inside it)."""
    norm = os.path.normpath(path)
    parts = [p for p in norm.split("/") if p]
    if not parts or norm in (".", "..") or parts[-1] == "..":
        raise UnsafeFile(path, "not a file path")
    if root is not None:
        if not norm.startswith("/"):
            raise UnsafeFile(path, "not an absolute path (a path in another mount namespace must be)")
        fd = _walk_in_root(root, parts[:-1], shown(path, root))
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)
        return
    fd = os.open("/" if norm.startswith("/") else ".", _DIR)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (or a file) where a directory should be
                    raise UnsafeFile(path, f"{part!r} on its path is a symbolic link or not a directory "
                                           "(refused: give the real path)") from None
                raise
            os.close(fd)
            fd = nxt
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _check(path: str, st: os.stat_result, want: str, owners: Collection[int] | None) -> None:
    kind = _kind(st.st_mode)
    if kind != want:
        raise UnsafeFile(path, f"is {kind}, not {want} (refused)")
    if st.st_nlink > 1:
        raise UnsafeFile(path, f"has {st.st_nlink} hard links (refused: another name may be a file its writer "
                               "could not read)")
    if owners is not None and st.st_uid not in owners:
        raise UnsafeFile(path, f"is owned by uid {st.st_uid}, not by {', '.join(map(str, sorted(owners)))} "
                               "(refused)")


@contextlib.contextmanager
def open_checked(path: str, flags: int, want: str = "a regular file",
                 owners: Collection[int] | None = None, root: str | None = None) -> Iterator[int]:
    """An fd of ``path`` opened with ``flags`` (plus no-follow, non-blocking), only if it is ``want`` ("a regular
    file" or "a FIFO"), has one link and an owner in ``owners`` (None: any). Raises UnsafeFile or OSError."""
    with _parent(path, root) as (dirfd, name):
        path = shown(path, root)
        before = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        _check(path, before, want, owners)
        try:
            fd = os.open(name, flags | _LAST, dir_fd=dirfd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # swapped for a link since the lstat
                raise UnsafeFile(path, "is a symbolic link (refused)") from None
            raise
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafeFile(path, "was replaced while it was opened (refused)")
        _check(path, st, want, owners)
        yield fd
    finally:
        os.close(fd)


def read_tail(path: str, max_bytes: int, owners: Collection[int] | None = None, root: str | None = None) -> bytes:
    """The last ``max_bytes`` (at most) of a regular file, safely opened (`open_checked`)."""
    with open_checked(path, os.O_RDONLY, owners=owners, root=root) as fd:
        size = os.fstat(fd).st_size
        return _read(fd, max(0, size - max_bytes), max_bytes)


def read_capped(path: str, max_bytes: int, owners: Collection[int] | None = None,
                root: str | None = None) -> bytes:
    """A whole regular file, safely opened; UnsafeFile when it holds more than ``max_bytes``."""
    with open_checked(path, os.O_RDONLY, owners=owners, root=root) as fd:
        data = _read(fd, 0, max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeFile(shown(path, root), f"holds more than {max_bytes} bytes (refused)")
    return data


def write_fifo(path: str, data: bytes, owners: Collection[int] | None = None, root: str | None = None) -> None:
    """Write ``data`` to a FIFO, never blocking, never to anything but a FIFO (a link, or a regular file where the
    pipe should be, is refused before a byte is written). ENXIO (OSError) when nobody reads it."""
    with open_checked(path, os.O_WRONLY, "a FIFO", owners, root) as fd:
        os.write(fd, data)


def lstat_at(path: str, root: str | None = None) -> os.stat_result:
    """``lstat`` of ``path``, its directories reached as `open_checked` reaches them. Raises UnsafeFile or OSError."""
    with _parent(path, root) as (dirfd, name):
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)


def unlink_at(path: str, root: str | None = None) -> None:
    """Remove the name ``path`` (not a directory; a link is removed, never followed) from its directory, reached as
    `open_checked` reaches it. Raises UnsafeFile or OSError."""
    with _parent(path, root) as (dirfd, name):
        os.unlink(name, dir_fd=dirfd)


def list_dir(path: str, root: str | None = None) -> list[str]:
    """The names in directory ``path``, reached as `open_checked` reaches a file's directory."""
    with _parent(os.path.join(path, "_"), root) as (dirfd, _):  # "_": a name in it, so the walk ends at it
        return os.listdir(dirfd)


def _read(fd: int, offset: int, limit: int) -> bytes:
    chunks, got = [], 0
    while got < limit:
        chunk = os.pread(fd, min(65536, limit - got), offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
