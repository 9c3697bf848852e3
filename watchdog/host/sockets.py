"""The TCP sockets listening in a process's network namespace, and the sockets the process holds, from /proc.

``/proc/PID/net/tcp`` and ``tcp6`` list every TCP socket of ``PID``'s network namespace (whoever holds it): one
line each, the local address as hex (host byte order, 32-bit words), the state (``0A``: LISTEN) and the socket's
inode. A process holds a socket when one of its ``/proc/PID/fd`` links reads ``socket:[INODE]``. `listeners`
parses a table's text; `read_listeners` and `socket_inodes` read them (empty when unreadable).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN in the tables' st column


@dataclass(frozen=True, slots=True)
class Listener:
    address: str  # "0.0.0.0", "::", "127.0.0.1"
    port: int
    inode: int


def listeners(table: str) -> list[Listener]:
    """The LISTEN sockets of one ``/proc/PID/net/tcp`` or ``tcp6`` table's text (a line it cannot read is left
    out)."""
    out = []
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != LISTEN or ":" not in f[1]:
            continue
        addr, port = f[1].rsplit(":", 1)
        try:
            out.append(Listener(address(addr), int(port, 16), int(f[9])))
        except ValueError:
            continue
    return out


def address(hexa: str) -> str:
    """A table's address (host byte order, 32-bit words) as text; ValueError when it is not one."""
    raw = bytes.fromhex(hexa)
    flipped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(flipped))


def read_listeners(pid: int, proc: str | Path = "/proc") -> list[Listener]:
    """The LISTEN sockets, IPv4 and IPv6, of ``pid``'s network namespace."""
    out = []
    for table in ("tcp", "tcp6"):
        try:
            out += listeners((Path(proc) / str(pid) / "net" / table).read_text(errors="replace"))
        except OSError:
            continue
    return out


def socket_inodes(pid: int, proc: str | Path = "/proc") -> set[int]:
    """The inodes of the sockets ``pid`` holds open."""
    out: set[int] = set()
    fd_dir = Path(proc) / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]") and target[8:-1].isdigit():
            out.add(int(target[8:-1]))
    return out


def held_listeners(pid: int, proc: str | Path = "/proc") -> list[Listener]:
    """The LISTEN sockets ``pid`` itself holds (not only its namespace's)."""
    mine = socket_inodes(pid, proc)
    return [x for x in read_listeners(pid, proc) if x.inode in mine]
