"""The throwaway systemd harness (tests/harness/systemd_ns.py) works here and leaves the machine as it was.

No real vLLM: the units are tiny venv-python programs. The whole file takes a few seconds.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.systemd_ns import ThrowawaySystemd, available

PYTHON = sys.executable
WEB_PORT = 8080  # on the namespace's own loopback: nothing else listens there

NOTIFY_PY = """\
import time
from systemd import daemon
print("notify unit starting", flush=True)
daemon.notify("READY=1")
print("notify unit ready", flush=True)
time.sleep(3600)
"""

WRITER_PY = """\
import os
import signal
from pathlib import Path
for d in ("/run/harness-out", "/tmp/harness-out"):
    Path(d).mkdir(parents=True, exist_ok=True)
    Path(d, "written.txt").write_text("greeting=" + os.environ.get("HARNESS_GREETING", "?"))
"""

UNITS = {
    "notify.service": f"[Service]\nType=notify\nExecStart={PYTHON} /run/harness-test/notify.py\n",
    "web.service": (
        f"[Service]\nType=simple\nExecStart={PYTHON} -m http.server {WEB_PORT} --bind 127.0.0.1 --directory /run/web\n"
    ),
    "writer.service": f"[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart={PYTHON} /run/harness-test/writer.py\n",
}
FILES = {
    "/run/harness-test/notify.py": NOTIFY_PY,
    "/run/harness-test/writer.py": WRITER_PY,
    "/run/web/hello.txt": "hello from inside",
}

FETCH = """\
import sys, time, urllib.request
deadline = time.monotonic() + 10
while True:
    try:
        print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
"""


def _require_available() -> None:
    reason = available()
    if reason is not None:
        pytest.fail(f"a throwaway systemd cannot run on this machine: {reason}")


def _marker_in_real_tmp() -> Path:
    fd, name = tempfile.mkstemp(prefix="systemd-ns-marker-", dir="/tmp")
    os.write(fd, b"must survive")
    os.close(fd)
    return Path(name)


@pytest.fixture(scope="module")
def marker() -> Iterator[Path]:
    path = _marker_in_real_tmp()
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def sd(marker: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThrowawaySystemd]:
    _require_available()
    ns = ThrowawaySystemd(
        "harness-test",
        UNITS,
        files=FILES,
        env={"HARNESS_GREETING": 'hi "there" $HOME %n'},
        log_dir=tmp_path_factory.mktemp("systemd-ns"),
    )
    ns.start(timeout=30.0)
    try:
        yield ns
    finally:
        ns.stop()
    assert marker.read_text() == "must survive"


def test_available() -> None:
    assert available() is None


def test_boots_to_running_quickly(sd: ThrowawaySystemd) -> None:
    assert sd.state == "running", sd.systemctl("--failed", check=False).stdout
    assert sd.run(["cat", "/proc/1/comm"], check=True).stdout.strip() == "systemd"
    assert sd.systemctl("is-system-running", check=False).stdout.strip() == "running"


def test_private_tmp_and_loopback(sd: ThrowawaySystemd, marker: Path) -> None:
    assert marker.exists()
    assert sd.run(["test", "-e", str(marker)]).returncode == 1  # its /tmp is not the machine's
    links = sd.run(["ip", "-o", "link"], check=True).stdout.splitlines()
    assert len(links) == 1 and " lo: " in links[0] and "UP" in links[0], links
    # The machine's enabled units and the dangerous early-boot units are out of reach.
    for unit in ("sysinit.target", "basic.target", "systemd-tmpfiles-setup.service", "systemd-tmpfiles-clean.timer"):
        assert sd.show(unit, "LoadState") == "masked", unit


def test_notify_unit_goes_active(sd: ThrowawaySystemd) -> None:
    pid = sd.wait_active("notify.service", timeout=15.0)
    assert pid > 0
    assert sd.show("notify.service", "Type") == "notify"
    deadline = time.monotonic() + 5.0
    while "notify unit ready" not in (log := sd.journal("notify.service", lines=20)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "notify unit ready" in log


def test_unit_writes_files_the_test_reads(sd: ThrowawaySystemd) -> None:
    sd.wait_active("writer.service", timeout=15.0)
    expected = 'greeting=hi "there" $HOME %n'  # DefaultEnvironment passes the value through untouched
    assert sd.read_file("/run/harness-out/written.txt") == expected
    assert sd.read_file("/tmp/harness-out/written.txt") == expected
    assert not Path("/tmp/harness-out").exists()


def test_simple_unit_reachable_and_restart_changes_main_pid(sd: ThrowawaySystemd) -> None:
    url = f"http://127.0.0.1:{WEB_PORT}/hello.txt"
    first = sd.wait_active("web.service", timeout=15.0)
    assert sd.run([PYTHON, "-c", FETCH, url], timeout=20.0, check=True).stdout.strip() == "hello from inside"
    host = sd.host_pid(first)
    assert "http.server" in Path(f"/proc/{host}/cmdline").read_bytes().decode()

    sd.systemctl("restart", "web.service", timeout=20.0)
    second = sd.wait_active("web.service", timeout=15.0)
    assert second not in (0, first)
    assert sd.run([PYTHON, "-c", FETCH, url], timeout=20.0, check=True).stdout.strip() == "hello from inside"


def test_stop_ends_everything_and_spares_real_tmp(tmp_path: Path) -> None:
    _require_available()
    marker = _marker_in_real_tmp()
    try:
        kept = tmp_path / "kept"  # under the machine's /tmp: bound back inside on request
        kept.mkdir()
        (kept / "from-host.txt").write_text("seen inside")
        ns = ThrowawaySystemd(
            "harness-stop",
            {
                "sleeper.service": (
                    f"[Service]\nExecStart=/bin/sleep 3600\nExecStop=/bin/sh -c 'echo stopped > {kept}/stopped.txt'\n"
                )
            },
            keep=[kept],
            log_dir=tmp_path / "logs",
        )
        with ns:
            assert ns.read_file(str(kept / "from-host.txt")) == "seen inside"
            sleeper = ns.host_pid(ns.wait_active("sleeper.service", timeout=15.0))
            systemd_pid, pgid, cgroup = ns.pid, ns.pgid, ns.cgroup_dir
            assert cgroup is not None and cgroup.is_dir()
        assert ns.unshare_exit_code == 0  # `systemctl exit` worked: nothing had to be killed
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
        for pid in (systemd_pid, sleeper):
            assert not Path(f"/proc/{pid}").exists(), pid
        assert not cgroup.exists()
        assert (kept / "stopped.txt").read_text() == "stopped\n"  # units were stopped, not just killed
        ns.stop()  # twice is fine
        assert marker.read_text() == "must survive"
    finally:
        marker.unlink(missing_ok=True)


def test_files_only_under_private_mounts() -> None:
    with pytest.raises(ValueError, match="only be written under"):
        ThrowawaySystemd("bad", {}, files={"/etc/harness-test.conf": "x"})
    with pytest.raises(ValueError, match="name"):
        ThrowawaySystemd("bad name", {})
    with pytest.raises(ValueError, match="unit name"):
        ThrowawaySystemd("bad", {"../escape.service": ""})


def test_stop_kills_a_hung_systemd(tmp_path: Path) -> None:
    _require_available()
    ns = ThrowawaySystemd(
        "harness-hung", {"sleeper.service": "[Service]\nExecStart=/bin/sleep 3600\n"}, log_dir=tmp_path
    )
    with ns:
        sleeper = ns.host_pid(ns.wait_active("sleeper.service", timeout=15.0))
        systemd_pid, pgid = ns.pid, ns.pgid
        os.kill(systemd_pid, signal.SIGSTOP)  # `systemctl exit` cannot work now: stop() must kill
        ns.stop(timeout=3.0)
    assert ns.unshare_exit_code not in (None, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    for pid in (systemd_pid, sleeper):
        assert not Path(f"/proc/{pid}").exists(), pid  # reaped, not left to the machine's init as a zombie
    assert ns.cgroup_dir is not None and not ns.cgroup_dir.exists()
