"""Run one command on this host to completion: an argv (never a shell), a timeout, a session of its own; the outcome
as data, never an exception.

Every command the watchdog starts and waits for comes through here: the restart steps (`act.restart`, and a node's
agent running one for the head), py-spy and the context commands (`evidence.collect.capture.run_argv`), Docker's
CLI (`host.docker_cli`), and the calls to other nodes (`nodes.transport`: ssh, the request on stdin, the answer
capped).

- `run`: stdout and stderr merged into a temporary file, its last ``OUTPUT_TAIL_BYTES`` kept (a file, not a pipe:
  a grandchild left holding the output cannot keep us waiting once the command itself exits);
- `communicate`: ``data`` written to stdin, stdout and stderr read apart until both close, with one deadline and a
  byte cap on each; past either the command is ended;
- `run_text`: `communicate`'s answer as (exit status, stdout, stderr), the shape the evidence's and Docker's
  callers take (`evidence.collect.capture.run_argv`, `host.docker_cli`).

Each command leads a session of its own (so its pid is its process group's id) and gets the watchdog's environment
minus what systemd meant for the watchdog alone (`childenv`). A command ended for its time or its output loses its
whole process group: SIGTERM, up to ``kill_grace`` seconds for the group to empty, then SIGKILL to what is left.
A command that exits by itself keeps what it started.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal

from watchdog.host.childenv import child_env

log = logging.getLogger(__name__)

OUTPUT_TAIL_BYTES = 2048  # `run`: how much of the merged output is kept, from its end
KILL_GRACE = 2.0  # seconds from SIGTERM to SIGKILL for an ended command's process group
MAX_STDOUT = 64 * 1024 * 1024  # `communicate`: the caps unless told
MAX_STDERR = 64 * 1024


@dataclass(frozen=True, slots=True)
class RunResult:
    argv: tuple[str, ...]
    rc: int | None  # None: it could not start, or it was ended (timed out, too much output)
    duration: float
    timed_out: bool = False
    output: str = ""  # `run`: the last ~2 KB of stdout and stderr, merged
    error: str = ""  # "" when rc == 0, else what went wrong in a few words
    stdout: bytes = b""  # `communicate`: what the command wrote, at most its cap
    stderr: bytes = b""
    too_big: bool = False  # `communicate`: ended for writing more than its cap

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out


class LocalRunner:
    """A restart `Runner` for this host: `run` with a fixed ``kill_grace``."""

    def __init__(self, kill_grace: float = KILL_GRACE) -> None:
        self.kill_grace = kill_grace

    def __call__(self, argv: Sequence[str], timeout: float) -> RunResult:
        return run(argv, timeout, self.kill_grace)


def run(argv: Sequence[str], timeout: float, kill_grace: float = KILL_GRACE) -> RunResult:
    """Run ``argv`` with stdin empty; its merged output's tail in ``output``."""
    args, started = tuple(argv), time.monotonic()
    with tempfile.TemporaryFile() as out:
        child = _start(args, started, subprocess.DEVNULL, out, subprocess.STDOUT)
        if isinstance(child, RunResult):
            return child
        try:
            rc: int | None = child.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            rc = None
            end_group(child, kill_grace)
        except BaseException:  # a signal handler's exception, KeyboardInterrupt: never leave it running behind us
            end_group(child, kill_grace)
            raise
        duration = time.monotonic() - started
        output = _tail(out)
    if rc is None:
        return RunResult(args, None, duration, True, output, f"timed out after {_secs(timeout)}s")
    return RunResult(args, rc, duration, False, output, exit_text(rc))


def communicate(argv: Sequence[str], timeout: float, data: bytes | None = None, max_out: int = MAX_STDOUT,
                max_err: int = MAX_STDERR, kill_grace: float = KILL_GRACE,
                stderr_overflow: Literal["end", "tail"] = "end") -> RunResult:
    """Run ``argv`` with ``data`` on its stdin (None: stdin empty), reading stdout and stderr apart until both close,
    ``timeout`` seconds at most for all of it; more than ``max_out`` bytes of stdout or ``max_err`` of stderr ends it
    (``too_big``, what was read kept up to the caps). ``stderr_overflow="tail"``: stderr past its cap does not end
    the command, only its last ``max_err`` bytes are kept (stderr is diagnostics: a chatty one must not cost the
    answer)."""
    args, started = tuple(argv), time.monotonic()
    child = _start(args, started, subprocess.DEVNULL if data is None else subprocess.PIPE, subprocess.PIPE,
                   subprocess.PIPE)
    if isinstance(child, RunResult):
        return child
    out, err = bytearray(), bytearray()
    ended = ""  # why we end it: "timed out", "too big"
    try:
        ended = _exchange(child, data or b"", out, err, started + timeout, max_out, max_err,
                          stderr_overflow == "tail")
        if not ended:
            try:
                child.wait(timeout=max(0.1, started + timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                ended = "timed out"
    except BaseException:  # never leave it running behind us
        end_group(child, kill_grace)
        raise
    finally:
        for f in (child.stdin, child.stdout, child.stderr):
            if f is not None:
                f.close()
    if ended:
        end_group(child, kill_grace)
    duration, stdout = time.monotonic() - started, bytes(out[:max_out])
    stderr = bytes(err[len(err) - max_err:] if stderr_overflow == "tail" and len(err) > max_err else err[:max_err])
    if ended == "timed out":
        return RunResult(args, None, duration, True, "", f"timed out after {_secs(timeout)}s", stdout, stderr)
    if ended:
        which = f"stdout over {max_out}" if len(out) > max_out else f"stderr over {max_err}"
        return RunResult(args, None, duration, False, "", f"{which} bytes: ended", stdout, stderr, too_big=True)
    rc = child.returncode
    return RunResult(args, rc, duration, False, "", exit_text(rc), stdout, stderr)


def run_text(argv: Sequence[str], timeout: float, max_out: int = MAX_STDOUT, max_err: int = MAX_STDERR,
             kill_grace: float = KILL_GRACE) -> tuple[int, str, str]:
    """`communicate` with stdin empty, its outcome as (exit status, stdout, stderr) text: 124 when it timed out
    (its process group ended), 127 when it could not start, 1 when its output was past a cap (what was read kept,
    the reason after stderr)."""
    r = communicate(argv, timeout, max_out=max_out, max_err=max_err, kill_grace=kill_grace)
    if r.timed_out:
        return 124, "", f"timed out after {timeout:g}s"
    out, err = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    if r.rc is None:
        return (1, out, err + r.error) if r.too_big else (127, "", r.error)
    return r.rc, out, err


def _exchange(child: subprocess.Popen[bytes], data: bytes, out: bytearray, err: bytearray, deadline: float,
              max_out: int, max_err: int, err_tail: bool = False) -> str:
    """Write ``data`` and read stdout and stderr until both close: "" then, else why it must be ended. ``err_tail``:
    stderr past ``max_err`` is cut from its front instead (only its tail kept), never a reason to end."""
    assert child.stdout is not None and child.stderr is not None
    pending = memoryview(data)
    with selectors.DefaultSelector() as sel:
        if child.stdin is not None:
            if pending:
                os.set_blocking(child.stdin.fileno(), False)  # a command that does not read cannot block us
                sel.register(child.stdin, selectors.EVENT_WRITE)
            else:
                child.stdin.close()
        sel.register(child.stdout, selectors.EVENT_READ, out)
        sel.register(child.stderr, selectors.EVENT_READ, err)
        while len(sel.get_map()):
            left = deadline - time.monotonic()
            if left <= 0:
                return "timed out"
            for key, _ in sel.select(left):
                if key.fileobj is child.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # it closed its stdin: what it does without the rest is its answer
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(child.stdin)
                        child.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if err_tail and len(err) > max_err:
                    del err[:len(err) - max_err]
                if len(out) > max_out or len(err) > max_err:
                    return "too big"
    return ""


def _start(args: tuple[str, ...], started: float, stdin: Any, stdout: Any,
           stderr: Any) -> subprocess.Popen[bytes] | RunResult:
    """The child, in a session of its own; or the result saying why it could not start."""
    if not args:
        return RunResult(args, None, 0.0, error="empty command")
    try:
        return subprocess.Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True,
                                env=child_env())
    except OSError as e:
        reason = ("program not found" if isinstance(e, FileNotFoundError) else "permission denied"
                  if isinstance(e, PermissionError) else f"cannot run ({e.strerror or e})")
        return RunResult(args, None, time.monotonic() - started, error=f"{reason}: {args[0]}")


def end_group(child: subprocess.Popen[Any], grace: float = KILL_GRACE) -> None:
    """End ``child``'s process group (its pgid is its pid: it leads a session of its own): SIGTERM, up to ``grace``
    seconds for the group to empty, then SIGKILL to whatever is left; the child is reaped."""
    signal_group(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:  # a wait for the group to empty, not a retry of a call: no place for tenacity
        child.poll()  # reap the child, so an empty group reads as gone
        if not signal_group(child.pid, 0):
            break
        time.sleep(0.05)
    signal_group(child.pid, signal.SIGKILL)
    try:
        child.wait(timeout=max(grace, 0.5))
    except subprocess.TimeoutExpired:  # stuck in the kernel (D state): give up, do not hang the caller
        log.warning("pid %d survived SIGKILL for %ss", child.pid, _secs(max(grace, 0.5)))


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal (it changed its uid): it still exists
        pass
    return True


def _tail(out: IO[bytes]) -> str:
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - OUTPUT_TAIL_BYTES))
    return out.read().decode("utf-8", errors="replace")


def exit_text(rc: int) -> str:
    """How a command ended, in words: "" for 0, "exit status N", or "killed by SIGNAME"."""
    if rc >= 0:
        return f"exit status {rc}" if rc else ""
    try:
        return f"killed by {signal.Signals(-rc).name}"
    except ValueError:
        return f"killed by signal {-rc}"


def _secs(seconds: float) -> str:
    return f"{seconds:.1f}".removesuffix(".0")
