"""Paths named by another process are paths in its mount namespace: where this host opens them.

An engine in a container names paths in its own filesystem (the Flight Recorder's pipe and dump prefixes in its
environment, a log file, its ``/dev/shm``). When its mount namespace is not ours (``/proc/PID/ns/mnt`` differs
from ``/proc/self/ns/mnt``) the host reaches them under ``/proc/PID/root``, with `watchdog.host.files`'s rules
(no link followed out of that root, size caps). In our own namespace (a bare process; ``--network host`` alone
does not change the mount namespace, ``--pid host`` neither) nothing changes: the path is the host's.

When the namespaces cannot be compared (``/proc/PID/ns/mnt`` unreadable: not root, another user's process) the
path is taken as the host's, as before: the open then fails or finds nothing, and the caller says so.
"""

from __future__ import annotations

import os


def root_of(pid: int | None, proc: str = "/proc") -> str | None:
    """``/proc/PID/root`` when ``pid`` runs in another mount namespace than this process; None in ours, for no
    pid, or when it cannot be told."""
    if pid is None:
        return None
    try:
        mine = os.readlink(f"{proc}/self/ns/mnt")
        theirs = os.readlink(f"{proc}/{pid}/ns/mnt")
    except OSError:
        return None
    return None if mine == theirs else f"{proc}/{pid}/root"


def host_path(path: str, root: str | None) -> str:
    """The host's name for ``path`` under ``root`` (for messages and for tools given a path, not an fd); the safe
    opening is `watchdog.host.files`'s, with ``root``."""
    return path if root is None else f"{root.rstrip('/')}/{path.lstrip('/')}"
