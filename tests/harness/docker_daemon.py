"""A Docker daemon of the tests' own: Debian's `dockerd`, started here, ended here, by its own pid.

Nothing on the machine runs dockerd. This one keeps its images under the cache (`cache_root()/docker`, so an image
built once serves every later run) and everything that lives only while it runs (its sockets, its containerd, the
containers' network namespaces) under a short directory in /tmp of its own. It runs in its own session; teardown
removes the containers it ran first, then SIGTERMs the daemon by its pid (SIGKILL to its own group if it lingers).

Tests talk to it through `cli(...)` (``docker -H unix://<its socket>``) or with ``DOCKER_HOST`` = `host` in the
environment of what they start (the watchdog's docker restart steps call plain ``docker``).

`userland_proxy=False` is dockerd's ``--userland-proxy=false``: a published port is then only iptables' DNAT, with
no process listening on the host. It is a daemon option, so that shape runs against a daemon started for it (one
daemon at a time: both would want the default bridge, docker0, and the same data root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.harness.engine_env import cache_root

LABEL = "engine-watchdog-test"  # every container the harness runs carries it; only those are removed


class DockerUnavailable(RuntimeError):
    """dockerd is not installed here, or did not come up (the message has its log tail)."""


def data_root() -> Path:
    return cache_root() / "docker"


def dockerd_binary() -> str:
    for path in ("/usr/sbin/dockerd", "/usr/bin/dockerd"):
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("dockerd")
    if not found:
        raise DockerUnavailable("dockerd is not installed (scripts/setup installs Debian's docker.io)")
    return found


class DockerDaemon:
    def __init__(self, *, userland_proxy: bool = True, iptables: bool = True, root: Path | None = None) -> None:
        self.userland_proxy = userland_proxy
        self.iptables = iptables
        self.root = root or data_root()
        self.run_dir = Path(tempfile.mkdtemp(prefix="ewd-", dir="/tmp"))  # short: unix socket paths are limited
        self.socket = self.run_dir / "docker.sock"
        self.pidfile = self.run_dir / "dockerd.pid"
        self.log_path = self.run_dir / "dockerd.log"
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """What DOCKER_HOST must say to reach this daemon."""
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise RuntimeError("dockerd not started")
        return self._popen.pid

    def argv(self) -> list[str]:
        return [
            dockerd_binary(),
            "--data-root", str(self.root),
            "--exec-root", str(self.run_dir / "exec"),
            "--pidfile", str(self.pidfile),
            "-H", self.host,
            f"--userland-proxy={'true' if self.userland_proxy else 'false'}",
            f"--iptables={'true' if self.iptables else 'false'}",
            "--log-level", "warn",
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> DockerDaemon:
        if self._popen is not None:
            raise RuntimeError("already started")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self._popen.poll() is not None:
                raise DockerUnavailable(f"dockerd exited with {self._popen.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                if self.cli("version", "--format", "{{.Server.Version}}", timeout=10, check=False).returncode == 0:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise DockerUnavailable(f"dockerd did not answer within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.3)
        self.remove_containers()  # a run killed before its teardown may have left some in the data root
        return self

    def cli(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``docker -H <ours> args...``; raises with its stderr when `check` and it fails."""
        r = subprocess.run(["docker", "-H", self.host, *args], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout, check=False, start_new_session=True, env=self.env())
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])}... failed ({r.returncode}): {r.stderr.strip()[-800:]}")
        return r

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose plain ``docker`` talks to this daemon."""
        env = dict(os.environ if base is None else base)
        env["DOCKER_HOST"] = self.host
        return env

    def containers(self, all_: bool = True) -> list[str]:
        r = self.cli("ps", *(["-a"] if all_ else []), "-q", "--filter", f"label={LABEL}", check=False)
        return r.stdout.split()

    def remove_containers(self, ids: Sequence[str] | None = None) -> None:
        for cid in self.containers() if ids is None else ids:
            self.cli("rm", "-f", cid, timeout=60, check=False)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """Containers first, then the daemon by its pid (its own group if it does not go). Idempotent."""
        p, self._popen = self._popen, None
        if p is not None and p.poll() is None:
            with contextlib.suppress(Exception):
                self.remove_containers()
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # the group id is the unreaped daemon's pid: ours alone
                p.wait(15)
        # dockerd leaves its own bind of the host's network namespace (<exec root>/netns/default) mounted: only
        # mounts under our own directory are undone, deepest first
        for mount in sorted(_mounts_under(self.run_dir), key=len, reverse=True):
            subprocess.run(["umount", mount], capture_output=True, timeout=30, check=False)
        if self.run_dir.exists() and not _mounts_under(self.run_dir):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> DockerDaemon:
        return self.start() if self._popen is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    with open("/proc/self/mounts") as f:
        return [fields[1] for fields in (line.split() for line in f) if len(fields) > 1
                and fields[1].startswith(prefix)]
