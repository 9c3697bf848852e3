"""Inside `unshare --mount --pid --fork`: mount what a root needs, chroot into it, exec the command.

    python -m tests.harness.chroot_exec ROOT CWD -- ARGV...

The mounts (proc for this PID namespace, the host's /dev and /sys read-only bind, tmpfs on /run and /tmp) are made in
the private mount namespace unshare made, so they vanish when it ends; nothing is mounted on the host.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _mount(*argv: str) -> None:
    subprocess.run(["mount", *argv], check=True, timeout=30)


def main(args: list[str]) -> int:
    if len(args) < 4 or args[2] != "--":
        print("usage: chroot_exec ROOT CWD -- ARGV...", file=sys.stderr)
        return 64
    root, cwd, command = args[0], args[1], args[3:]
    _mount("-t", "proc", "proc", f"{root}/proc")
    _mount("--rbind", "/dev", f"{root}/dev")
    _mount("--rbind", "/sys", f"{root}/sys")
    _mount("-o", "remount,bind,ro", f"{root}/sys")
    for tmp in ("run", "tmp"):
        _mount("-t", "tmpfs", "-o", "mode=1777" if tmp == "tmp" else "mode=0755", "tmpfs", f"{root}/{tmp}")
    os.chroot(root)
    os.chdir(cwd)
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
