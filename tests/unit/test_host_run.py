"""watchdog.host.run for real: exit status in words, programs that cannot start, timeouts that end the whole process
group (a grandchild that ignores SIGTERM included), stdin data, and the byte caps of `communicate`.

Every command runs in a session of its own (that is the module's promise); each test writes down the group ids its
commands report, and the fixture kills each of those groups by its id at teardown, should the module have failed."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.fakes import is_gone, read_pids
from watchdog.host.run import KILL_GRACE, LocalRunner, communicate, exit_text, run

# the command (a shell, its own group's leader) starts a grandchild that ignores SIGTERM; the grandchild, once its
# trap is set, writes "<the leader's pid> <its own pid>" to $1 and becomes a sleep. The leader ignores SIGTERM too
# until that file exists, so a timeout that comes early (a slow machine) still finds the group stubborn: SIGTERM
# never ends it, only the SIGKILL after the grace does
STUBBORN = ('trap "" TERM; (trap "" TERM; echo "$$ $(exec sh -c \'echo $PPID\')" > "$1.new"; mv "$1.new" "$1"; '
            'exec sleep 60) & while [ ! -s "$1" ]; do sleep 0.01; done; trap - TERM; wait')


def test_exit_status_in_words() -> None:
    assert exit_text(0) == "" and exit_text(3) == "exit status 3"
    assert exit_text(-9) == "killed by SIGKILL" and exit_text(-200) == "killed by signal 200"
    killed = run(["/bin/sh", "-c", "kill -TERM $$"], 10)
    assert killed.rc == -15 and killed.error == "killed by SIGTERM" and not killed.ok
    failed = communicate(["/bin/sh", "-c", "echo out; echo err >&2; exit 4"], 10)
    assert (failed.rc, failed.error, failed.stdout, failed.stderr) == (4, "exit status 4", b"out\n", b"err\n")
    ok = communicate([sys.executable, "-c", "print('fine')"], 20)
    assert ok.ok and ok.error == "" and ok.stdout == b"fine\n" and not ok.timed_out and not ok.too_big


@pytest.mark.parametrize("how", ["run", "communicate"])
def test_a_program_that_cannot_start_is_a_result(how: str, tmp_path: Path) -> None:
    call = run if how == "run" else communicate
    missing = call(["no-such-program-for-the-watchdog"], 10)
    assert missing.rc is None and missing.error == "program not found: no-such-program-for-the-watchdog"
    assert not missing.ok and not missing.timed_out
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    assert call([str(script)], 10).error == f"permission denied: {script}"
    assert call([], 10).error == "empty command"


@pytest.mark.parametrize("how", ["run", "communicate"])
def test_timeout_ends_the_whole_group_a_grandchild_ignoring_sigterm_too(how: str, tmp_path: Path,
                                                                        groups: list[int]) -> None:
    pid_file = tmp_path / "pids"
    argv = ["/bin/sh", "-c", STUBBORN, "sh", str(pid_file)]
    grace = 1.0
    result = run(argv, 1.0, grace) if how == "run" else communicate(argv, 1.0, b"{}", kill_grace=grace)
    child, grandchild = read_pids(pid_file)
    groups.append(child)  # the group, should the module have failed to end it
    assert os.getpgid(os.getpid()) != child  # its own group, not ours
    assert result.timed_out and result.rc is None and not result.ok
    assert result.error == "timed out after 1s"
    # SIGTERM ended the shell, not the grandchild: the group lived on for the grace, then SIGKILL
    assert 1.0 + grace * 0.9 <= result.duration < 1.0 + grace + 8
    assert is_gone(grandchild) and is_gone(child)


def test_communicate_waits_for_both_pipes_and_ends_a_grandchild_holding_them(tmp_path: Path,
                                                                             groups: list[int]) -> None:
    """The answer is whole only when stdout closes: a grandchild holding it is ended with the group at the deadline
    (`run` writes to a file instead and does not wait for it: tests/unit/test_restart.py)."""
    pid_file = tmp_path / "pids"
    result = communicate(["/bin/sh", "-c", 'sleep 60 & echo "$$ $!" > "$1"; echo started', "sh", str(pid_file)],
                         3.0, kill_grace=0.5)
    child, grandchild = read_pids(pid_file)
    groups.append(child)
    assert result.timed_out and result.stdout == b"started\n"
    assert is_gone(grandchild)


def test_stdin_data_larger_than_a_pipe_is_written_whole() -> None:
    data = bytes(range(256)) * 2000  # 512 KB: many times a pipe's buffer
    result = communicate(["cat"], 20, data)
    assert result.ok and result.stdout == data


def test_a_command_that_never_reads_its_stdin_cannot_block_the_write() -> None:
    result = communicate(["/bin/sh", "-c", "exec 0<&-; sleep 0.2; echo done"], 20, b"x" * 1024 * 1024)
    assert result.ok and result.stdout == b"done\n" and result.duration < 10


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_the_byte_cap_ends_a_flood(stream: str, tmp_path: Path, groups: list[int]) -> None:
    pid_file = tmp_path / "pid"
    fd = 1 if stream == "stdout" else 2
    flood = (f"import os, sys, time\nopen({str(pid_file)!r}, 'w').write(f'{{os.getpid()}}\\n')\n"
             f"os.write({fd}, b'y' * 200000)\ntime.sleep(60)\n")
    started = time.monotonic()
    result = communicate([sys.executable, "-c", flood], 30, max_out=1000, max_err=500, kill_grace=0.5)
    [pid] = read_pids(pid_file)
    groups.append(pid)
    assert time.monotonic() - started < 20  # well before the sleep or the timeout
    assert result.too_big and result.rc is None and not result.timed_out and not result.ok
    cap = 1000 if stream == "stdout" else 500
    assert getattr(result, stream) == b"y" * cap
    assert result.error == f"{stream} over {cap} bytes: ended"
    assert is_gone(pid)


def test_local_runner_is_run_with_its_grace() -> None:
    assert LocalRunner().kill_grace == KILL_GRACE
    result = LocalRunner(kill_grace=0.5)(["/bin/sh", "-c", "echo hi; exit 2"], 10)
    assert result.rc == 2 and result.error == "exit status 2" and result.output == "hi\n"


class Interrupted(Exception):
    pass


def test_a_run_interrupted_by_a_signal_handler_leaves_nothing_of_its_group(tmp_path: Path, groups: list[int]) -> None:
    """An exception out of the wait (the agent's `Ended`, raised by its SIGTERM handler) ends the command's group
    before it goes up: nothing is left running behind the caller."""
    pid_file = tmp_path / "pids"

    def interrupt(signum: int, frame: object) -> None:
        if not pid_file.exists():  # the group not stubborn yet: a little later
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            return
        raise Interrupted

    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(Interrupted):
            run(["/bin/sh", "-c", STUBBORN, "sh", str(pid_file)], 60, 0.5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    child, grandchild = read_pids(pid_file)
    groups.append(child)
    assert is_gone(grandchild, 1.0) and is_gone(child, 1.0)


def test_stderr_past_its_cap_keeps_its_tail_when_asked() -> None:
    """``stderr_overflow="tail"``: a chatty stderr does not end the command; its last bytes are kept."""
    chatty = "import os\nfor i in range(100):\n    os.write(2, b'x' * 1000 + b'%d\\n' % i)\nprint('answer')\n"
    result = communicate([sys.executable, "-c", chatty], 30, max_err=500, stderr_overflow="tail")
    assert result.ok and not result.too_big and result.stdout == b"answer\n"
    assert len(result.stderr) == 500 and result.stderr.endswith(b"x99\n")
    ended = communicate([sys.executable, "-c", chatty], 30, max_err=500)
    assert ended.too_big and ended.error == "stderr over 500 bytes: ended"
