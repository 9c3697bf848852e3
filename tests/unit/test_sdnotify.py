"""sd_notify (libsystemd's, through systemd-python) on a real unix datagram socket made by the test (a path and an
abstract `@` name), and the watchdog ping: at half of WATCHDOG_USEC, only for WATCHDOG_PID, only when the loop asks.
libsystemd reads the process's own $NOTIFY_SOCKET: the tests that send set it there too."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdog.evidence.collect.capture import Capturer, run_argv
from watchdog.evidence.collect.context import LogSource, log_tail
from watchdog.host.childenv import OURS_ALONE, child_env
from watchdog.host.run import LocalRunner
from watchdog.service.sdnotify import Notifier, notify_address, watchdog_interval

SHOWN = (*OURS_ALONE, "WD_TEST_MARKER")
# a real child that prints (part of) the environment it was given, as one JSON line
PRINT_ENV = f"""#!{sys.executable}
import json, os
print(json.dumps({{k: os.environ.get(k) for k in {SHOWN!r}}}))
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, socket.socket]]:
    """(the NOTIFY_SOCKET value, the bound socket that receives what is sent to it); the value is in this process's
    environment too, where libsystemd reads it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        value = str(tmp_path / "notify.sock")
        sock.bind(value)
    else:
        value = f"@engine-watchdog-test-{os.getpid()}-{threading.get_ident()}"
        sock.bind("\0" + value[1:])
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    yield value, sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    """Every datagram waiting on the socket, now."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(5)
    return out


def test_ready_status_stopping_reach_the_socket(listener: tuple[str, socket.socket]) -> None:
    value, sock = listener
    n = Notifier({"NOTIFY_SOCKET": value})
    assert n.enabled and n.watchdog_interval is None and n.ping_due_in() is None
    n.ready("engine 0: idle")
    assert sock.recv(4096).decode() == "READY=1\nSTATUS=engine 0: idle"  # no WATCHDOG=1 without WatchdogSec
    n.status("engine 0: idle")  # unchanged, no watchdog: nothing to say
    n.status("engine 0: frozen")
    n.stopping()
    assert received(sock) == ["STATUS=engine 0: frozen", "STOPPING=1\nSTATUS=stopping"]
    assert not n.ping_if_due()
    n.close()


def test_pings_at_half_the_watchdog_interval_and_only_when_asked(listener: tuple[str, socket.socket]) -> None:
    value, sock = listener
    clock = Clock()
    n = Notifier({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "4242"}, clock, pid=4242)
    assert n.watchdog_interval == 10.0 and n.ping_every == 5.0
    assert n.ping_due_in() == 0.0  # nothing sent yet: due at once
    n.ready("starting")
    assert sock.recv(4096).decode() == "READY=1\nSTATUS=starting\nWATCHDOG=1"
    clock.now += 3.0
    assert n.ping_due_in() == pytest.approx(2.0)
    assert not n.ping_if_due()
    n.status("engine 0: idle")  # a pass: its status, no ping yet
    assert received(sock) == ["STATUS=engine 0: idle"]
    clock.now += 2.0
    assert n.ping_due_in() == 0.0 and n.ping_if_due()
    assert received(sock) == ["WATCHDOG=1"]
    clock.now += 4.9
    n.status("engine 0: idle")
    assert received(sock) == []  # unchanged and not due
    clock.now += 0.1
    n.status("engine 0: working")
    assert received(sock) == ["STATUS=engine 0: working\nWATCHDOG=1"]  # one datagram
    clock.now += 60.0  # the loop was away for a long time: one ping when it comes back, never a backlog
    assert n.ping_if_due() and not n.ping_if_due()
    assert received(sock) == ["WATCHDOG=1"]
    n.close()


def test_no_thread_pings_for_a_wedged_loop(listener: tuple[str, socket.socket]) -> None:
    """Nothing is sent unless the loop calls: a loop that stops calling stops the pings (systemd then acts)."""
    value, sock = listener
    before = set(threading.enumerate())
    n = Notifier({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "100000"})  # 0.1 s: a ping every 50 ms
    n.ready("up")
    assert sock.recv(4096).decode().endswith("WATCHDOG=1")
    assert set(threading.enumerate()) == before
    sock.settimeout(0.5)  # ten ping intervals
    with pytest.raises(TimeoutError):
        sock.recv(4096)
    assert n.ping_if_due()
    assert sock.recv(4096).decode() == "WATCHDOG=1"
    n.close()


def test_by_default_the_process_environment_decides(listener: tuple[str, socket.socket]) -> None:
    value, sock = listener
    n = Notifier()
    assert n.enabled and n.address == notify_address(value)
    n.ready("up")
    assert sock.recv(4096).decode().startswith("READY=1\nSTATUS=up") and n.sent == 1
    n.close()


def test_watchdog_pid_of_another_process_means_no_watchdog(listener: tuple[str, socket.socket]) -> None:
    value, sock = listener
    n = Notifier({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, pid=os.getpid())
    assert n.watchdog_interval is None and n.ping_due_in() is None
    n.ready("up")
    assert sock.recv(4096).decode() == "READY=1\nSTATUS=up"
    assert not n.ping_if_due()
    n.close()


def test_watchdog_without_a_socket_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier({"WATCHDOG_USEC": "2000000"})
    assert not n.enabled and n.ping_due_in() is None and not n.ping_if_due()
    n.ready("up")
    n.status("up")
    n.stopping()
    assert n.sent == 0


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
    ({"WATCHDOG_USEC": "ten"}, None),
    ({"WATCHDOG_USEC": "3000000"}, 3.0),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "77"}, 3.0),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "78"}, None),
])
def test_watchdog_interval_reads_like_sd_watchdog_enabled(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env, 77) == expected


def test_notify_socket_forms() -> None:
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@/org/freedesktop/systemd1/notify/123") == "\0/org/freedesktop/systemd1/notify/123"
    assert notify_address("") is None and notify_address("@") is None and notify_address("relative.sock") is None
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_a_socket_that_went_away_is_logged_once_and_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gone.sock"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    clock = Clock()
    n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"}, clock)
    n.ready("up")
    n.status("still up")
    assert not n.ping_if_due()  # the failed ping counts: no retry storm from a loop that asks often
    n.stopping()
    assert n.sent == 0
    assert [r.getMessage() for r in caplog.records].count(f"sd_notify to {path} failed: "
                                                           "[Errno 2] No such file or directory") == 1
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        n.status("back")
        assert sock.recv(4096).decode() == "STATUS=back"
        clock.now += 0.5
        n.status("back")
        assert sock.recv(4096).decode() == "WATCHDOG=1"
    finally:
        sock.close()
        n.close()


# ----------------------------------------------------------------------------- NOTIFY_SOCKET stays ours


@pytest.fixture
def under_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This process's environment as systemd gives it; returns a directory holding the env-printing program."""
    monkeypatch.setenv("NOTIFY_SOCKET", "@/org/freedesktop/systemd1/notify/42")
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WD_TEST_MARKER", "kept")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("print-env", "journalctl"):
        (bin_dir / name).write_text(PRINT_ENV)
        (bin_dir / name).chmod(0o755)
    return bin_dir


CLEAN = {"NOTIFY_SOCKET": None, "WATCHDOG_USEC": None, "WATCHDOG_PID": None, "WD_TEST_MARKER": "kept"}


def test_child_env_drops_only_what_systemd_meant_for_us() -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin", "HOME": "/root"}
    assert child_env(env) == {"PATH": "/bin", "HOME": "/root"}


def test_pyspy_runs_without_notify_variables(under_systemd: Path) -> None:
    rc, out, err = run_argv([str(under_systemd / "print-env")], 30)
    assert rc == 0 and json.loads(out) == CLEAN, err
    dump = Capturer(str(under_systemd / "print-env"), timeout=30).dump_one(os.getpid())  # the py-spy command line
    assert dump.ok and json.loads(dump.output) == CLEAN, dump


def test_context_commands_run_without_notify_variables(under_systemd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{under_systemd}:{os.environ['PATH']}")  # our journalctl prints its environment
    text, where, problem = log_tail(LogSource(journal_unit="vllm.service"))
    assert where == "journalctl -u vllm.service" and not problem
    assert json.loads(text) == CLEAN


def test_restart_commands_run_without_notify_variables(under_systemd: Path) -> None:
    result = LocalRunner()([str(under_systemd / "print-env")], 30)
    assert result.ok and json.loads(result.output) == CLEAN, result


# ----------------------------------------------------------------------------- the daemon's loop and the ping

QUIET = """
[probe]
enabled = false
[capture]
enabled = false
[exporter]
port = 0
"""


def start_daemon(tmp_path: Path, notify: str, url: str, config: str,
                 procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    (tmp_path / "wd.toml").write_text(config + QUIET)
    p = subprocess.Popen([sys.executable, "-m", "watchdog", "run", "--url", url, "--state-dir", str(tmp_path / "state"),
                          "--config", str(tmp_path / "wd.toml")],
                         env=dict(os.environ, NOTIFY_SOCKET=notify, WATCHDOG_USEC="1000000"),  # a ping every 0.5 s
                         text=True, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs.append(p)
    return p


def stop_daemon(p: subprocess.Popen[str]) -> str:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    return err


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_the_loop_wakes_up_to_ping_between_long_passes(tmp_path: Path,
                                                       daemon_proc: list[subprocess.Popen[str]]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(20)
    try:
        p = start_daemon(tmp_path, str(tmp_path / "notify.sock"), closed_port(), "[scrape]\ninterval = 60.0\n",
                         daemon_proc)
        assert sock.recv(4096).decode().startswith("READY=1\n")
        pings = [sock.recv(4096).decode() for _ in range(4)]
        assert pings == ["WATCHDOG=1"] * 4
        stop_daemon(p)
    finally:
        sock.close()
    trace = [json.loads(line) for line in (tmp_path / "state" / "trace.jsonl").read_text().splitlines()]
    assert sum(1 for r in trace if r.get("kind") == "scrape") == 1  # one pass, five pings


class HeldServer:
    """Answers the first pass at once (the filtered page, then the whole one it is checked against: a small reading,
    one connection each), then holds the next connection open until released."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.holding, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            for _ in range(2):
                conn, _ = self.sock.accept()
                with conn:
                    conn.recv(65536)
                    page = b'vllm:num_requests_running{engine="0"} 0\n'
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                                 b"Connection: close\r\n\r\n%s" % (len(page), page))
            held, _ = self.sock.accept()
            with held:
                self.holding.set()
                self.release.wait(60)

    def close(self) -> None:
        self.release.set()
        self.sock.close()
        self.thread.join(10)


def test_no_ping_while_the_loop_is_stuck_in_a_pass(tmp_path: Path, daemon_proc: list[subprocess.Popen[str]]) -> None:
    """The ping comes from the loop, never from a thread beside it: a pass that hangs stops the pings."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + f"engine-watchdog-test-{os.getpid()}-stuck")
    sock.settimeout(20)
    server = HeldServer()
    try:
        p = start_daemon(tmp_path, f"@engine-watchdog-test-{os.getpid()}-stuck", server.url,
                         "[scrape]\ninterval = 1.0\nread_timeout = 60.0\ndeadline = 60.0\n", daemon_proc)
        assert sock.recv(4096).decode().startswith("READY=1\n")
        assert server.holding.wait(20), "the second pass never scraped"
        received(sock)  # pings sent before the second pass began
        sock.settimeout(3.0)  # six ping intervals
        with pytest.raises(TimeoutError):
            print("sent while stuck:", sock.recv(4096))
        server.close()  # the scrape fails, the pass ends, the loop pings again (later scrapes: refused)
        sock.settimeout(20)
        assert "WATCHDOG=1" in sock.recv(4096).decode()
        stop_daemon(p)
    finally:
        server.close()
        sock.close()


def test_without_systemd_python_the_watchdog_imports_and_still_notifies(tmp_path: Path) -> None:
    """Seen on the H200 device (no libsystemd there): `import systemd.daemon` was unconditional, so the watchdog could
    not start. In a fresh interpreter where systemd-python cannot be imported, the CLI and the daemon import, and
    READY=1 still reaches $NOTIFY_SOCKET (a real datagram socket)."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        srv.settimeout(20)
        code = ("import sys\nsys.modules['systemd'] = None\nsys.modules['systemd.daemon'] = None\n"
                "import watchdog.cli.main, watchdog.service.daemon\n"
                "from watchdog.service.sdnotify import Notifier\nNotifier().ready('watching')\n")
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NOTIFY_SOCKET": path},
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        assert srv.recv(200) == b"READY=1\nSTATUS=watching"
