"""watchdog.host.ptrace: Yama's scope and CAP_SYS_PTRACE, read from files the test writes (and once from this host)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from watchdog.host.ptrace import attach_check, attach_forbidden, has_cap_sys_ptrace, scope_note, yama_scope

WITH_CAP = "Name:\tpython\nCapEff:\t000001ffffffffff\n"
WITHOUT_CAP = "Name:\tpython\nCapEff:\t0000000000000000\n"


def files(tmp_path: Path, scope: str | None, status: str) -> tuple[Path, Path]:
    yama = tmp_path / "ptrace_scope"
    if scope is not None:
        yama.write_text(scope + "\n")
    st = tmp_path / "status"
    st.write_text(status)
    return yama, st


def test_scope_read_once_for_every_use(tmp_path: Path) -> None:
    yama, _ = files(tmp_path, "3", WITH_CAP)
    assert yama_scope(yama) == "3" and attach_forbidden(yama)
    assert scope_note(yama) == " (kernel.yama.ptrace_scope is 3 here: no attach at all, until reboot)"
    absent = tmp_path / "no-yama"
    assert yama_scope(absent) == "" and not attach_forbidden(absent) and scope_note(absent) == ""


def test_scope_3_forbids_even_with_the_capability(tmp_path: Path) -> None:
    assert attach_check(*files(tmp_path, "3", WITH_CAP)) == (False, "kernel.yama.ptrace_scope is 3: no attach at all")


@pytest.mark.parametrize(("scope", "why"), [("1", "CAP_SYS_PTRACE, ptrace_scope 1"), (None, "CAP_SYS_PTRACE")])
def test_the_capability_allows(tmp_path: Path, scope: str | None, why: str) -> None:
    assert attach_check(*files(tmp_path, scope, WITH_CAP)) == (True, why)


def test_without_the_capability(tmp_path: Path) -> None:
    allowed, why = attach_check(*files(tmp_path, "2", WITHOUT_CAP))
    assert not allowed and why.startswith("no CAP_SYS_PTRACE (ptrace_scope 2)")
    allowed, why = attach_check(*files(tmp_path, "0", WITHOUT_CAP))
    assert allowed == (os.geteuid() != 0)  # scope 0: the same user may attach (root without the cap may not)


def test_an_unreadable_status_is_no_capability(tmp_path: Path) -> None:
    assert not has_cap_sys_ptrace(tmp_path / "absent")
    (tmp_path / "odd").write_text("CapEff:\n")
    assert not has_cap_sys_ptrace(tmp_path / "odd")


def test_this_host_answers() -> None:
    allowed, why = attach_check()
    assert isinstance(allowed, bool) and why
