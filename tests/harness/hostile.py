"""Helpers for the hostile tests of the node agent and the head (tests/unit/test_agent_*.py, test_head_hostile.py):

- `NOBODY`: a command prefix that runs as the unprivileged user ``nobody`` (a local user of the node, or the
  engine's own user, in the threat model);
- `run_agent`: the real agent (``python -m watchdog.nodes.agent``) as sshd would start it, a request on stdin, in a
  session of its own, under a memory limit (an attack that grows it fails, it cannot take the machine);
- `records`: the audit log's JSON lines;
- `Cgroup`: a cgroup of the test's own below this process's (in the hierarchy systemd tracks units in), to stand a
  process in a "unit" or a "container" as systemd or Docker would; removed at the end;
- `fake_ssh`: an ``ssh`` program for `NodeLink(ssh=...)` that plays a hostile node (answers from a file per verb).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
NOBODY_UID = 65534
MEMORY_LIMIT = 1 << 30  # bytes of address space for an agent run directly


def run_agent(config: Path, verb: str | None, request: bytes = b"", timeout: float = 30.0,
              python: str = sys.executable) -> tuple[int | None, str, str, float]:
    """(exit status or None when it had to be killed, stdout, stderr, seconds) of one agent session."""
    env = {k: v for k, v in os.environ.items() if k != "SSH_ORIGINAL_COMMAND"}
    if verb is not None:
        env["SSH_ORIGINAL_COMMAND"] = verb
    env["SSH_CLIENT"] = "10.9.9.9 5555 22"
    t0 = time.monotonic()
    p = subprocess.Popen(["prlimit", f"--as={MEMORY_LIMIT}", "--", python, "-m", "watchdog.nodes.agent", "--config",
                          str(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(request, timeout=timeout)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    return rc, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - t0


def records(audit_log: Path, since: int = 0) -> list[dict[str, Any]]:
    """The audit records written after byte ``since`` (every line must be one JSON object)."""
    text = audit_log.read_text()[since:] if audit_log.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _hierarchy() -> tuple[Path, str] | None:
    """(mount point, this process's path) of the hierarchy systemd tracks units in, if we may write it."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, _, path = line.rpartition(":")
        own[hier.split(":", 1)[1]] = path
    for mount, key in ((Path("/sys/fs/cgroup/systemd"), "name=systemd"), (Path("/sys/fs/cgroup/unified"), ""),
                       (Path("/sys/fs/cgroup"), "")):
        if (mount / "cgroup.procs").exists() and key in own and os.access(mount, os.W_OK):
            return mount, own[key]
    return None


class Cgroup:
    """``relative`` (``system.slice/x.service``, ``docker/<id>``) below this process's cgroup; `add` moves a pid
    in. Only what it created is removed (after its processes ended)."""

    def __init__(self, relative: str) -> None:
        found = _hierarchy()
        self.usable = found is not None
        self.made: list[Path] = []
        if found is None:
            return
        mount, own = found
        self.path = mount / own.lstrip("/") / relative
        for part in reversed([self.path, *self.path.parents]):
            if part.is_relative_to(mount / own.lstrip("/")) and not part.exists():
                part.mkdir()
                self.made.append(part)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for part in reversed(self.made):
            deadline = time.monotonic() + 10
            while True:
                try:
                    part.rmdir()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)  # its last process is still being reaped

    def __enter__(self) -> Cgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def nobodys_dir(prefix: str) -> Iterator[Path]:
    """A directory of the engine's user (nobody) under /tmp, where that user can reach it (pytest's temp directory
    is root's only); removed at the end."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o755)
    os.chown(d, NOBODY_UID, NOBODY_UID)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def hex_id() -> str:
    return secrets.token_hex(32)


@contextlib.contextmanager
def started(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """A process in a session of its own, ended (its whole group) on the way out."""
    p = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def titled(p: subprocess.Popen[bytes], prefix: str = "VLLM::", timeout: float = 10.0) -> int:
    """The host pid of what ``p`` runs once its command line starts with ``prefix`` (``exec -a`` done): waited for,
    never guessed with a sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in [str(p.pid), *Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(prefix.encode()):
                    return int(pid)
        time.sleep(0.02)
    raise AssertionError(f"pid {p.pid} never took a title starting with {prefix!r}")


def leaf_pid(p: subprocess.Popen[bytes], timeout: float = 5.0) -> int:
    """The host pid of what ``nsenter`` (or setpriv) runs: its child, or itself once it has exec'd."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    return p.pid


FAKE_SSH = r'''#!{python}
"""A hostile node: plays ssh for NodeLink. The master (-M) makes its control socket and waits; a call reads its
request and answers with the file {answers}/<verb> (its bytes as they are), or <verb>.py run as a program."""
import os, socket, sys, time
args = sys.argv[1:]
path = next(a.split("=", 1)[1] for i, a in enumerate(args) if a.startswith("ControlPath="))
if "-M" in args:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    while True:
        time.sleep(60)
verb = args[-1]
sys.stdin.buffer.read()
answer = os.path.join({answers!r}, verb)
if os.path.exists(answer + ".py"):
    os.execv(sys.executable, [sys.executable, answer + ".py"])
sys.stdout.buffer.write(open(answer, "rb").read())
'''


def fake_ssh(directory: Path) -> tuple[Path, Path]:
    """(the fake ssh program, the directory its answers are read from)."""
    answers = directory / "answers"
    answers.mkdir(parents=True, exist_ok=True)
    prog = directory / "ssh"
    prog.write_text(FAKE_SSH.format(python=sys.executable, answers=str(answers)))
    prog.chmod(0o755)
    return prog, answers
