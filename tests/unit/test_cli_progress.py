"""Progress of `check`, `dump` and `nodes` on stderr when it is a terminal (a real pty), nothing extra when piped;
Ctrl-C on a terminal ends a verb with one line, no traceback."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.fakes import FAST, EngineModel, fake_engine
from watchdog.cli.progress import Progress


class OnTerminal:
    """A real `watchdog` process whose stderr is the slave side of a pty (stdout a pipe, as `| jq` would be)."""

    def __init__(self, *args: str) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "watchdog", *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=slave, text=True, start_new_session=True)
        # the slave side kept open here until the output is read: when its last holder closes, the kernel hangs the
        # terminal up and may drop what is still in its buffer (seen: one progress line of two, on a loaded machine)
        self.slave: int | None = slave
        self.master, self.chunks, self.seen = master, [], threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: every slave side closed, the process ended
                break
            if not data:
                break
            self.chunks.append(data)
            self.seen.set()

    @property
    def stderr(self) -> str:
        return b"".join(self.chunks).decode(errors="replace").replace("\r\n", "\n")

    def wait_for(self, text: str, timeout: float = 60) -> None:
        waited = 0.0
        while text not in self.stderr:
            assert self.proc.poll() is None, f"ended before {text!r}: {self.stderr}"
            assert waited < timeout, f"no {text!r} on the terminal: {self.stderr}"
            self.seen.wait(0.2)
            self.seen.clear()
            waited += 0.2

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            while self.seen.wait(0.5):  # drained: nothing more came for half a second
                self.seen.clear()
            if self.slave is not None:
                os.close(self.slave)
                self.slave = None
            self.reader.join(10)
            os.close(self.master)
        return self.proc.returncode, out, self.stderr


def piped(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "watchdog", *args], capture_output=True, text=True, timeout=120,
                          start_new_session=True, check=False)


def progress_lines(stderr: str, verb: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"watchdog {verb}: ")]


def fast(tmp_path: Path, extra: str = "") -> str:
    path = tmp_path / "fast.toml"
    path.write_text(FAST + extra)
    return str(path)


def test_check_says_what_it_watches_on_a_terminal_and_nothing_when_piped(tmp_path: Path) -> None:
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, _):
        args = ("check", "--url", url, "--config", fast(tmp_path), "--json")
        rc, out, err = OnTerminal(*args).finish()
        plain = piped(*args)
    lines = progress_lines(err, "check")
    assert rc == 0 and json.loads(out)["engines"][0]["state"] == "idle", err
    assert re.match(rf"watchdog check: \d+\.\ds: watching {url} for up to 10s", lines[0]), lines
    assert any("engine 0 " in line for line in lines[1:]), lines
    assert any("a probe generation is out" in line for line in lines), lines  # idle is proven by a generation
    assert plain.returncode == 0 and json.loads(plain.stdout)["engines"][0]["state"] == "idle"
    assert not progress_lines(plain.stderr, "check") and "watching" not in plain.stderr, plain.stderr


def _closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# `dump` with nothing behind its port looks for engine titles anywhere on the host: these match none of them (a
# real vLLM of someone else's may run here, and its processes are never this test's to py-spy)
NO_ENGINE = """
[capture]
process_prefix = "NO-SUCH-ENGINE::"
title_filter = "no-such-engine-here"
[gpu]
enabled = false
"""


def test_dump_says_each_stage_on_a_terminal_and_nothing_when_piped(tmp_path: Path) -> None:
    config = tmp_path / "no-engine.toml"
    config.write_text(NO_ENGINE)
    args = ("dump", "--url", _closed_url(), "--config", str(config), "--out", str(tmp_path / "out"), "--json")
    rc, out, err = OnTerminal(*args).finish()
    lines = progress_lines(err, "dump")
    said = "\n".join(lines)
    assert rc == 2 and json.loads(out)["bundle"], err  # nothing found to take stacks of: exit 2, a bundle still
    for stage in ("reading the page at http://127.0.0.1:", "finding the engine's processes, then py-spy: 2 rounds",
                  "stacks of 0 processes in ", "writing the bundle"):
        assert stage in said, said
    plain = piped(*args)
    assert plain.returncode == 2 and json.loads(plain.stdout)["bundle"]
    assert not progress_lines(plain.stderr, "dump"), plain.stderr


NODES = """
[[nodes]]
name = "worker{n}"
host = "127.0.0.1"
port = {port}
identity_file = "{home}/no-such-key"
known_hosts_file = "{home}/known_hosts"
"""


def test_nodes_says_each_node_as_it_is_checked_on_a_terminal_and_nothing_when_piped(tmp_path: Path) -> None:
    port = _closed_url().rsplit(":", 1)[1]
    config = tmp_path / "head.toml"
    config.write_text("".join(NODES.format(n=n, port=port, home=tmp_path) for n in (1, 2)))
    rc, out, err = OnTerminal("nodes", "--config", str(config)).finish()
    lines = progress_lines(err, "nodes")
    assert rc == 1 and "worker1" in out and "worker2" in out, err
    assert "checking 2 node(s) over ssh: worker1, worker2" in lines[0]
    assert sorted(line.split(": ", 2)[2].split(":")[0] for line in lines[1:]) == ["worker1", "worker2"]
    assert [line.rsplit("(", 1)[1] for line in lines[1:]] == ["1 of 2 checked)", "2 of 2 checked)"]
    plain = piped("nodes", "--config", str(config), "--json")
    assert plain.returncode == 1 and len(json.loads(plain.stdout)["nodes"]) == 2
    assert not progress_lines(plain.stderr, "nodes"), plain.stderr


def test_ctrl_c_on_a_terminal_is_one_line_and_exit_130_never_a_traceback(tmp_path: Path) -> None:
    with fake_engine(EngineModel(running=4, gen=100)) as (url, _):  # busy, nothing moves: check watches on
        term = OnTerminal("check", "--url", url, "--seconds", "60")
        try:
            term.wait_for("engine 0 ")
        finally:
            os.killpg(term.proc.pid, signal.SIGINT)  # what the terminal's ^C sends: the foreground group
            rc, out, err = term.finish()
    assert rc == 130 and err.endswith("watchdog: interrupted\n"), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and out == ""


class _Terminal(io.StringIO):
    """A terminal that yields the GIL inside every write, as a real one under load would: lines written in pieces by
    two threads interleave here."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        time.sleep(0.001)
        self.writes.append(text)
        return super().write(text)


def test_progress_from_many_threads_writes_each_line_whole() -> None:
    term = _Terminal()
    said = Progress("nodes", term)
    gate = threading.Barrier(8)

    def say(n: int) -> None:
        gate.wait()
        for i in range(5):
            said.say(f"node{n}: fine ({i})")

    threads = [threading.Thread(target=say, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(term.writes) == 40 and all(w.endswith("\n") and w.count("\n") == 1 for w in term.writes)
    lines = term.getvalue().splitlines()
    assert sorted(line.split(": ", 2)[2] for line in lines) == sorted(
        f"node{n}: fine ({i})" for n in range(8) for i in range(5))
