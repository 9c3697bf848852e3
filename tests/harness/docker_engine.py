"""The real CPU vLLM (TP=2) in a Docker container, in each network shape a user runs, watched from the host.

No registry is reachable, so the image is made here: `docker import` of a tarball of a few empty directories, the
merged-/usr symlinks (bin, lib, lib64, sbin) and a minimal /etc (passwd, group). Its tag carries the tarball's
hash, so a second run (the daemon's data root is under the cache) finds it and builds nothing. What the engine
needs comes in at run time through read-only bind mounts: the host's /usr (Python's shared libraries, the C
library), the Python installation the engine venv's python links into (at its own path: the venv's ``pyvenv.cfg``
``home`` names it), the model (at its own path), and the engine venv at `VENV_INSIDE`, a path the host does not
have: what the watchdog reads of the venv (versions) it must read inside the container. The command is that venv's
own ``bin/python`` (a link into the Python installation; started by the link's path, Python finds ``pyvenv.cfg``
beside it, and its prefix is the venv). /tmp and /root (HOME) are tmpfs; /dev/shm is the container's own
(``--shm-size``), unless ``ipc_host``. The environment names a Flight Recorder (`FR_ENV`: buffer, pipe and dump
prefixes in the container's /tmp, ``SPT_NOENV=1`` so titled processes keep their environ): the CPU engine makes no
pipe (gloo has no dump pipe), a test makes one inside the container.

The command line and environment are the bare servers' (`tests.harness.server.VllmServer.args`, `BASE_ENV`): only
the address differs. Shapes (`SHAPES`):

- ``published``: ``-p 127.0.0.1:<host port>:8000`` with the daemon's userland proxy on (the default): on the host
  the port's listener is docker-proxy; the engine's processes are not its descendants;
- ``host``: ``--network host``: the API server itself listens on the host's port, as a bare server does;
- ``proxy-off``: the same ``-p`` against a daemon started with ``--userland-proxy=false``: no process on the host
  listens; iptables' DNAT carries the connection into the container.

The ranks' host pids come from the container's init pid (``docker inspect``, .State.Pid: the API server, pid 1
inside) and its descendants in the host's /proc; a rank is stopped from the host by that pid (tests.harness.faults).
`stop()` continues every stopped process of the container, then removes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests

from tests.harness.docker_daemon import LABEL, DockerDaemon
from tests.harness.metrics import watched
from tests.harness.server import BASE_ENV, VllmServer, free_port, one_titled, titled

SHAPES = ("published", "host", "proxy-off")
VENV_INSIDE = Path("/opt/vllm-venv")  # where the container sees the engine venv; nothing is there on the host
FR_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/tmp/fr_pipe_",
          "TORCH_FR_DUMP_TEMP_FILE": "/tmp/fr_dump_", "SPT_NOENV": "1"}
CONTAINER_PORT = 8000
IMAGE_REPO = "engine-watchdog-test/base"


def base_tarball() -> bytes:
    """The image's whole filesystem, byte for byte the same on every run (fixed owners, modes and times)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        def add(name: str, kind: bytes, mode: int, target: str = "", data: bytes = b"") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.linkname, info.size = kind, mode, 0, target, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        for d in ("usr", "etc", "tmp", "root", "proc", "sys", "dev", "run", "var", "var/tmp"):
            add(d, tarfile.DIRTYPE, 0o1777 if d in ("tmp", "var/tmp") else 0o755)
        for link in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr, as on the host
            add(link, tarfile.SYMTYPE, 0o777, f"usr/{link}")
        add("etc/passwd", tarfile.REGTYPE, 0o644, data=b"root:x:0:0:root:/root:/bin/sh\n")
        add("etc/group", tarfile.REGTYPE, 0o644, data=b"root:x:0:\n")
    return buf.getvalue()


def ensure_image(daemon: DockerDaemon, work_dir: Path) -> str:
    """The base image's tag, importing it only when this daemon's data root does not have it yet."""
    data = base_tarball()
    tag = f"{IMAGE_REPO}:{hashlib.sha256(data).hexdigest()[:16]}"
    if daemon.cli("image", "inspect", tag, check=False).returncode == 0:
        return tag
    tar = work_dir / "engine-watchdog-base.tar"
    tar.write_bytes(data)
    daemon.cli("import", "--message", "engine-watchdog test base (empty; everything is bind-mounted)",
               str(tar), tag, timeout=120)
    return tag


class DockerVllm:
    """One CPU vLLM TP=2 in a container of `shape`; `url` is where the host reaches it."""

    def __init__(self, daemon: DockerDaemon, image: str, python: Path, model: Path, *, shape: str, name: str,
                 shm_size: str = "1g", ipc_host: bool = False) -> None:
        if shape not in SHAPES:
            raise ValueError(f"shape {shape!r} is not one of {SHAPES}")
        if (shape == "proxy-off") == daemon.userland_proxy:
            raise ValueError(f"shape {shape!r} needs a daemon with userland_proxy={shape != 'proxy-off'}")
        self.daemon, self.image, self.shape, self.name = daemon, image, shape, name
        self.python, self.model = Path(python), Path(model)
        self.host_port = free_port()
        inside = ("127.0.0.1", self.host_port) if shape == "host" else ("0.0.0.0", CONTAINER_PORT)
        # the bare server's own command line (never started): only the address differs
        self.spec = VllmServer(VENV_INSIDE / "bin" / "python", self.model, Path("/tmp"), host=inside[0],
                               port=inside[1], name=name)
        self.model_name = self.spec.model_name
        self.shm_size, self.ipc_host = shm_size, ipc_host
        self.started_at: float | None = None
        self.ready_after: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.host_port}"

    def run_args(self) -> list[str]:
        venv = self.python.parent.parent
        # the installation the venv's python links into (pyenv's here: /root/.pyenv/versions/3.11.7)
        python_home = Path(os.path.realpath(self.python)).parents[1]
        if VENV_INSIDE.exists():
            raise RuntimeError(f"{VENV_INSIDE} exists on this host: the container's venv must be at a path it lacks")
        mounts = [(Path("/usr"), Path("/usr")), *([] if python_home.is_relative_to("/usr") else
                                                  [(python_home, python_home)]),
                  (venv, VENV_INSIDE), (self.model, self.model)]
        args = ["run", "--detach", "--name", self.name, "--label", LABEL, "--workdir", "/tmp",
                "--tmpfs", "/tmp:exec,mode=1777", "--tmpfs", "/root:mode=0700"]
        args += ["--ipc", "host"] if self.ipc_host else ["--shm-size", self.shm_size]
        if self.shape == "host":
            args += ["--network", "host"]
        else:
            args += ["--publish", f"127.0.0.1:{self.host_port}:{CONTAINER_PORT}"]
        for there, inside in mounts:
            args += ["--volume", f"{there}:{inside}:ro"]
        env = {**BASE_ENV, **FR_ENV, "HOME": "/root", "PATH": f"{VENV_INSIDE}/bin:/usr/local/bin:/usr/bin:/bin"}
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        return [*args, self.image, *self.spec.args]

    def start(self) -> DockerVllm:
        self.started_at = time.monotonic()
        self.daemon.cli(*self.run_args(), timeout=120)
        return self

    # ----------------------------------------------------------------- state, as the harness sees it

    def inspect(self) -> dict[str, Any]:
        r = self.daemon.cli("inspect", "--type", "container", self.name, check=False)
        if r.returncode != 0:
            return {}
        found: list[dict[str, Any]] = json.loads(r.stdout)
        return found[0] if found else {}

    def exit_code(self) -> int | None:
        state = self.inspect().get("State") or {}
        if state.get("Running"):
            return None
        return int(state.get("ExitCode", -1)) if state else -1

    def is_alive(self) -> bool:
        return self.exit_code() is None

    @property
    def pid(self) -> int:
        """The container's init (the API server) as the host numbers it; 0 when it is not running."""
        return int((self.inspect().get("State") or {}).get("Pid") or 0)

    def host_processes(self) -> list[psutil.Process]:
        pid = self.pid
        if not pid:
            return []
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        return []

    def processes(self) -> dict[str, psutil.Process]:
        """By title, as VllmServer.processes: "api_server", "VLLM::EngineCore", "VLLM::Worker_TP0", ..."""
        return titled(self.pid, self.host_processes())

    def process(self, title: str) -> psutil.Process:
        return one_titled(self.processes(), title)

    def exec(self, *argv: str, detach: bool = False, timeout: float = 30.0) -> str:
        """``docker exec`` in the running container (the host's /usr is there): its stdout; raises when it fails."""
        return self.daemon.cli("exec", *(["--detach"] if detach else []), self.name, *argv, timeout=timeout).stdout

    def log_tail(self, n: int = 60) -> str:
        r = self.daemon.cli("logs", "--tail", str(n), self.name, check=False)
        return (r.stdout + r.stderr).strip()

    # ----------------------------------------------------------------- serving

    def wait_ready(self, timeout: float = 240.0) -> float:
        """Until a real completion succeeds through `url`; seconds since start()."""
        assert self.started_at is not None, "not started"
        deadline, last = time.monotonic() + timeout, "no attempt yet"
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise RuntimeError(f"container {self.name} exited ({code}) before it served:\n{self.log_tail()}")
            try:
                self.complete("ready", max_tokens=1, timeout=max(1.0, min(15.0, deadline - time.monotonic())))
                self.ready_after = time.monotonic() - self.started_at
                return self.ready_after
            except requests.RequestException as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise TimeoutError(f"container {self.name} not serving after {timeout:.0f} s ({last}):\n{self.log_tail()}")

    def complete(self, prompt: str, max_tokens: int = 16, timeout: float = 120.0, **extra: Any) -> Any:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, **extra}
        r = requests.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def metrics(self, timeout: float = 5.0) -> str:
        r = requests.get(f"{self.url}/metrics", timeout=timeout)
        r.raise_for_status()
        return r.text

    def running(self) -> float:
        return watched(self.metrics()).get("vllm:num_requests_running", 0.0)

    # ----------------------------------------------------------------- ending

    def continue_all(self) -> None:
        """SIGCONT to every stopped process of the container (psutil checks each pid is still the same one)."""
        for proc in self.host_processes():
            with contextlib.suppress(psutil.Error):
                if proc.status() == psutil.STATUS_STOPPED:
                    proc.resume()

    def stop(self) -> None:
        """Continue what was stopped, then remove the container (the daemon kills what is left). Idempotent."""
        self.continue_all()
        self.daemon.cli("rm", "--force", self.name, timeout=90, check=False)

    def __repr__(self) -> str:
        return f"<DockerVllm {self.name} {self.shape} {self.url}>"
