"""The worker node's own Docker: a second dockerd inside the worker's namespaces, and the worker's half of the
two-node vLLM in a container on it.

`NodeDocker` starts Debian's dockerd inside the `SshNode`'s network, PID and mount namespaces (``nsenter`` into its
PID 1's), in a session of its own, as the node's own daemon would run:

- first a tmpfs of its own on the node's ``/run`` (made in the node's mount namespace only; ``/run/sshd`` made
  again in it for sshd's privilege separation), so the daemon's defaults are the node's alone: its socket is
  ``/run/docker.sock`` (= ``/var/run/docker.sock``, where a plain ``docker`` on the node, the agent's restart
  step included, finds it), its exec root ``/run/docker`` (its containerd, the containers' state), its pidfile;
- its images under the cache (`cache_root()/docker-worker`: the base image imported once, kept for later runs);
- ``--bridge=none --iptables=false``: no docker0, no NAT; the worker's half runs with ``--network host``, which is
  the node's network namespace with its end of the veth;
- ``--cgroup-parent /ewd-node-<tag>``: the node's containers apart from any other daemon's.

From this (root) namespace the daemon is reached through the node's root, ``/proc/<node PID 1>/root/run/
docker.sock`` (`host`, `cli`). `stop` removes its containers, SIGTERMs the daemon by its host pid, waits for it,
undoes the mounts it left in the node (under /run) and the /run tmpfs, and removes its empty cgroups.

`WorkerContainer` runs the worker's half (``vllm serve --headless --node-rank 1``, the argv and environment
`TwoNodeVllm` writes for it) in a container on that daemon, the engine venv, Python, /usr, the model and the
harness's launcher bind-mounted read-only (`tests.harness.docker_engine`'s image). `DockerWorkerPair` is a
`TwoNodeVllm` whose worker half is that container.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil

from tests.harness.docker_daemon import LABEL, DockerDaemon, DockerUnavailable, dockerd_binary
from tests.harness.docker_engine import ensure_image
from tests.harness.engine_env import cache_root
from tests.harness.sshnode import SshNode
from tests.harness.two_node import SERVE, TwoNodeVllm

SOCKET = "/run/docker.sock"  # inside the node: docker's default (/var/run is /run)
EXEC_ROOT = "/run/docker"
CGROUP_ROOT = "/sys/fs/cgroup"


class NodeDocker(DockerDaemon):
    def __init__(self, node: SshNode) -> None:
        super().__init__(iptables=False, root=cache_root() / "docker-worker")
        self.node = node
        self.cgroup_parent = f"/ewd-node-{node.tag}"
        self.socket = Path(f"/proc/{node.sshd_pid}/root{SOCKET}")  # the node's socket, from here
        self.dockerd_pid = 0  # the daemon's pid in this namespace (nsenter's child)
        self.mounts_before: set[str] = set()

    def argv(self) -> list[str]:
        return [*self.node.nsenter(), dockerd_binary(),
                "--data-root", str(self.root), "--exec-root", EXEC_ROOT, "--pidfile", "/run/docker.pid",
                "-H", f"unix://{SOCKET}", "--bridge=none", "--iptables=false", "--ip-masq=false",
                "--userland-proxy=false", "--cgroup-parent", self.cgroup_parent, "--log-level", "warn"]  # fmt: skip

    def in_node(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*self.node.nsenter(), *argv], capture_output=True, text=True, timeout=30, check=False)
        if check and r.returncode != 0:
            raise DockerUnavailable(f"in node {self.node.name}: {argv}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def mount_ids(self) -> list[tuple[str, str]]:
        """(mount id, mount point) of the node's mount namespace, in mount order."""
        rows = self.in_node("cat", "/proc/self/mountinfo").stdout.splitlines()
        return [(f[0], f[4]) for f in (row.split() for row in rows) if len(f) > 4]

    def start(self, timeout: float = 60.0) -> NodeDocker:
        self.mounts_before = {mid for mid, _ in self.mount_ids()}
        try:
            # the node's own /run (its mount namespace only: rprivate since the node's boot)
            self.in_node("sh", "-c", "mount -t tmpfs -o mode=0755,size=64m tmpfs /run && mkdir -m 0755 /run/sshd")
            # `ip netns exec` gave the node a sysfs of its own, without the cgroup hierarchies dockerd needs: the
            # host's are mounted again there (the same hierarchies: the node's containers are in the host's trees)
            self.in_node("mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "cgroup_root", CGROUP_ROOT)
            for kind, path, options in host_cgroup_mounts():
                self.in_node("mkdir", "-p", path)
                self.in_node("mount", "-t", kind, "-o", options, kind, path)
            super().start(timeout)
        except BaseException:
            self.stop()
            raise
        assert self._popen is not None
        kids = Path(f"/proc/{self._popen.pid}/task/{self._popen.pid}/children").read_text().split()
        self.dockerd_pid = int(kids[0]) if kids else 0
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Containers, then the daemon by its own pid; the node's mounts it left and /run; its cgroups."""
        p, self._popen = self._popen, None
        if p is not None:
            if p.poll() is None:
                with contextlib.suppress(Exception):
                    self.remove_containers()
            pid = self.dockerd_pid
            if not pid:
                with contextlib.suppress(OSError, ValueError):
                    pid = int(Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()[0])
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).wait(timeout)
            try:
                p.wait(15)  # nsenter follows its child
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # our own session: nsenter and what is left of the daemon
                p.wait(15)
        with contextlib.suppress(Exception):  # the mounts made in the node since start(), newest first
            for mount in reversed([path for mid, path in self.mount_ids() if mid not in self.mounts_before]):
                self.in_node("umount", mount, check=False)
        for controller in Path("/sys/fs/cgroup").iterdir():
            parent = controller / self.cgroup_parent.lstrip("/")
            if parent.is_dir():
                for d in sorted((x for x in parent.rglob("*") if x.is_dir()), key=lambda x: len(str(x)), reverse=True):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    parent.rmdir()
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)


def host_cgroup_mounts() -> list[tuple[str, str, str]]:
    """(type, path, options) of this namespace's cgroup hierarchies under /sys/fs/cgroup."""
    with open("/proc/self/mounts") as f:
        rows = [line.split() for line in f]
    return [(r[2], r[1], r[3]) for r in rows if len(r) > 3 and r[2] in ("cgroup", "cgroup2")
            and r[1].startswith(f"{CGROUP_ROOT}/")]


class WorkerContainer:
    """The worker's half (headless, node rank 1) in a container on the node's daemon, ``--network host``."""

    def __init__(self, daemon: NodeDocker, image: str, python: Path, model: Path, spec: dict[str, object],
                 name: str) -> None:
        self.daemon, self.image, self.python, self.model = daemon, image, python, model
        self.spec, self.name = spec, name

    def run_args(self) -> list[str]:
        venv = self.python.parent.parent
        python_home = Path(os.path.realpath(self.python)).parents[1]
        mounts = [Path("/usr"), *([] if python_home.is_relative_to("/usr") else [python_home]), venv, self.model,
                  SERVE.parent]
        args = ["run", "--detach", "--name", self.name, "--label", LABEL, "--network", "host", "--workdir", "/tmp",
                "--tmpfs", "/tmp:exec,mode=1777", "--tmpfs", "/root:mode=0700", "--shm-size", "1g"]
        for m in mounts:
            args += ["--volume", f"{m}:{m}:ro"]
        env = {**dict(self.spec["env"]), "HOME": "/root",  # type: ignore[call-overload]
               "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin"}
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        return [*args, self.image, *list(self.spec["argv"])]  # type: ignore[call-overload]

    def start(self) -> None:
        self.daemon.cli(*self.run_args(), timeout=120)

    def remove(self) -> None:
        self.daemon.cli("rm", "--force", self.name, timeout=90, check=False)

    def state(self) -> dict[str, object]:
        r = self.daemon.cli("inspect", "--type", "container", self.name, check=False)
        found = json.loads(r.stdout) if r.returncode == 0 else []
        return dict(found[0]["State"]) if found else {}

    def log_tail(self, n: int = 40) -> str:
        r = self.daemon.cli("logs", "--tail", str(n), self.name, check=False)
        return (r.stdout + r.stderr).strip()[-3000:]


class DockerWorkerPair(TwoNodeVllm):
    """`TwoNodeVllm` with the worker's half in a container on the node's own dockerd (`NodeDocker`)."""

    def __init__(self, root: Path, engine_python: Path, model: Path, node: SshNode, daemon: NodeDocker,
                 image: str, container: str) -> None:
        super().__init__(root, engine_python, model, node)
        self.container = WorkerContainer(daemon, image, engine_python, model, {}, container)

    def do(self, verb: str, role: str) -> None:
        if role == "head":
            super().do(verb, role)
        elif verb == "start":
            self.container.spec = json.loads((self.run / "worker.json").read_text())
            self.container.remove()
            self.container.start()
        elif verb == "stop":
            self.container.remove()

    def log_tail(self, role: str, n: int = 3000) -> str:
        return self.container.log_tail() if role == "worker" else super().log_tail(role, n)

    def worker_processes(self) -> dict[str, psutil.Process]:
        """The container's processes by title, as this (root) namespace numbers them: descendants of the node's
        PID 1 (the containerd shim is its child) under the container's init."""
        out: dict[str, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            for proc in psutil.Process(self.node.sshd_pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    title = (proc.cmdline() or [""])[0]
                    if title.startswith("VLLM::"):
                        out.setdefault(title.strip(), proc)
        return out

    def pids(self, role: str) -> dict[str, int]:
        if role != "worker":
            return super().pids(role)
        return {title: p.pid for title, p in self.worker_processes().items()}

    def continue_all(self) -> None:
        for proc in self.worker_processes().values():
            with contextlib.suppress(psutil.Error):
                if proc.status() == psutil.STATUS_STOPPED:
                    proc.resume()


@contextlib.contextmanager
def docker_worker_pair(root: Path, engine_python: Path, model: Path, agent_toml: str, work: Path,
                       container: str) -> Iterator[DockerWorkerPair]:
    """The worker node with its own dockerd and the pair started (the worker's half in its container); all of it
    ended on the way out: the pair, the daemon (its mounts and cgroups), the node."""
    node = SshNode(root, agent_toml).start()
    daemon: NodeDocker | None = None
    pair: DockerWorkerPair | None = None
    try:
        daemon = NodeDocker(node).start()
        image = ensure_image(daemon, work)
        pair = DockerWorkerPair(root, engine_python, model, node, daemon, image, container)
        pair.start()
        yield pair
    finally:
        if pair is not None:
            pair.continue_all()
            pair.close()
        if daemon is not None:
            daemon.stop()
        node.close()
