"""`watchdog.host.proc_stat` and `watchdog.host.sockets` on a real child process (its own session, killed by its
pid after the test), and a stat line whose name holds ``) `` as a literal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdog.host.proc_stat import CLK_TCK, ProcStat, parse_stat, read_stat
from watchdog.host.sockets import Listener, held_listeners, read_listeners, socket_inodes

# a process that named itself "a) S 1 (b": the fields still count from the last ')'
TRICKY = ("4242 (a) S 1 (b) R 17 4242 4242 0 -1 4194560 120 0 0 0 250 37 0 0 20 0 3 0 987654 10485760 512 "
          "18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n")


def test_a_name_with_parens_and_spaces_does_not_shift_the_fields() -> None:
    assert parse_stat(TRICKY) == ProcStat(pid=4242, comm="a) S 1 (b", state="R", ppid=17, utime=250, stime=37,
                                          num_threads=3, starttime=987654)
    assert parse_stat(TRICKY).cpu_seconds == pytest.approx(287 / CLK_TCK)


@pytest.mark.parametrize("text", ["", "4242 (x) S 1 2 3", "no parens at all " * 5,
                                  "4242 (a) b) R" + " 0" * 18,  # one field short of the start time
                                  TRICKY.replace(" 17 ", " x ", 1), TRICKY.replace("4242 (", "(")])
def test_what_is_not_a_stat_line_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a /proc/PID/stat line"):
        parse_stat(text)


def test_a_missing_or_garbled_stat_reads_as_gone(tmp_path: Path) -> None:
    assert read_stat(1, tmp_path) is None
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (x) S\n")
    assert read_stat(7, tmp_path) is None
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "stat").write_text(TRICKY.replace("4242 (", "8 ("))
    assert read_stat(8, tmp_path) == parse_stat(TRICKY.replace("4242 (", "8 ("))


LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
idle = socket.socket()
idle.bind(("127.0.0.1", 0))
print(s.getsockname()[1], idle.getsockname()[1], flush=True)
time.sleep(120)
"""


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """A sleeping python in a session of its own, listening on one port and holding a bound, unlistening one."""
    p = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout is not None
        port, idle = map(int, p.stdout.readline().split())
        yield p, port, idle
    finally:
        if p.poll() is None:  # a test may have ended it (and reaped it: its pid is no longer ours to signal)
            os.kill(p.pid, signal.SIGKILL)
        p.wait(10)


def test_a_live_child_reads_as_itself(child: tuple[subprocess.Popen[str], int, int]) -> None:
    p, _, _ = child
    st = read_stat(p.pid)
    assert st is not None and st.pid == p.pid and st.ppid == os.getpid() and st.state == "S"
    assert st.comm == Path(sys.executable).name[:15] and st.num_threads == 1
    assert read_stat(p.pid) == st  # asleep: nothing moved, the same start time
    me = read_stat(os.getpid())
    assert me is not None and me.starttime < st.starttime  # it started after this test process


def test_a_killed_child_is_gone(child: tuple[subprocess.Popen[str], int, int]) -> None:
    p, _, _ = child
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    assert read_stat(p.pid) is None
    assert read_listeners(p.pid) == [] and socket_inodes(p.pid) == set() and held_listeners(p.pid) == []


def test_cpu_seconds_count_what_the_process_used() -> None:
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    st = read_stat(os.getpid())
    times = os.times()
    assert st is not None and st.cpu_seconds >= 0.3
    assert abs(st.cpu_seconds - (times.user + times.system)) < 0.1


def test_the_childs_listener_is_found_and_its_idle_socket_is_not(child: tuple[subprocess.Popen[str], int, int]) -> None:
    p, port, idle = child
    held = held_listeners(p.pid)
    assert [(x.address, x.port) for x in held] == [("127.0.0.1", port)]
    assert held[0].inode in socket_inodes(p.pid) and len(socket_inodes(p.pid)) == 2  # the listener and the idle one
    assert held[0] in read_listeners(p.pid) and all(x.port != idle for x in read_listeners(p.pid))
    # this test's process shares the namespace, so it sees the listener, but does not hold it
    assert held[0] in read_listeners(os.getpid()) and held[0] not in held_listeners(os.getpid())


def test_an_ipv6_listener_reads_as_its_address() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    s = socket.socket(socket.AF_INET6)
    try:
        s.bind(("::1", 0))
    except OSError:
        s.close()
        pytest.skip("no ::1 here")
    with s:
        s.listen()
        assert Listener("::1", s.getsockname()[1], os.fstat(s.fileno()).st_ino) in held_listeners(os.getpid())
