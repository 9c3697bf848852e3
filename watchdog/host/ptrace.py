"""Whether this host lets us ptrace (py-spy attaches with it): Yama's ``kernel.yama.ptrace_scope`` and our
CAP_SYS_PTRACE, read in one place for the capture's hint, the preflight and a node's ``version`` answer."""

from __future__ import annotations

import os
from pathlib import Path

YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
NO_ATTACH = "3"  # Yama's scope 3: no process may ptrace another, whatever its privileges, until reboot
CAP_SYS_PTRACE = 19
MEANINGS = {"0": "classic", "1": "restricted: only descendants, unless CAP_SYS_PTRACE",
            "2": "admin-only: CAP_SYS_PTRACE needed", NO_ATTACH: "no attach at all, until reboot"}


def yama_scope(path: Path = YAMA_SCOPE) -> str:
    """``kernel.yama.ptrace_scope`` as written there ("0" to "3"); "" when there is no Yama (or it cannot be read)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def attach_forbidden(path: Path = YAMA_SCOPE) -> bool:
    """True when Yama forbids every attach (scope 3): no privilege helps, only a reboot."""
    return yama_scope(path) == NO_ATTACH


def scope_note(path: Path = YAMA_SCOPE) -> str:
    """What the scope is here, for a denied attach's hint: `` (kernel.yama.ptrace_scope is N here: meaning)``, or
    nothing when there is no Yama."""
    scope = yama_scope(path)
    if not scope:
        return ""
    return f" (kernel.yama.ptrace_scope is {scope} here: {MEANINGS.get(scope, 'unknown')})"


def has_cap_sys_ptrace(status: Path = Path("/proc/self/status")) -> bool:
    """CAP_SYS_PTRACE in this process's effective set."""
    try:
        text = status.read_text()
        cap_eff = int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return bool(cap_eff & (1 << CAP_SYS_PTRACE))


def attach_check(path: Path = YAMA_SCOPE, status: Path = Path("/proc/self/status")) -> tuple[bool, str]:
    """Whether py-spy may attach to the engine here, and why: CAP_SYS_PTRACE in effect and Yama not at 3, or the
    same user under scope 0."""
    scope = yama_scope(path)
    if scope == NO_ATTACH:
        return False, "kernel.yama.ptrace_scope is 3: no attach at all"
    if has_cap_sys_ptrace(status):
        return True, "CAP_SYS_PTRACE" + (f", ptrace_scope {scope}" if scope else "")
    if scope in ("", "0") and os.geteuid() != 0:
        return True, "same user, ptrace_scope 0 (no CAP_SYS_PTRACE: only this user's processes)"
    return False, f"no CAP_SYS_PTRACE (ptrace_scope {scope or 'absent'}): run the agent as root or give it the cap"
