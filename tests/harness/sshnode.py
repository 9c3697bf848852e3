"""A second "node" on this machine: a network namespace joined to the head by a veth pair, and inside it, in a PID
and mount namespace of its own, a real sshd (Debian's openssh-server) whose only key runs the watchdog agent as a
forced command. Keys, host key and configs are made here, under the test's own directory.

`head_netns=False`: the head end of the veth stays in this process's network namespace (the test talks to the node
directly); True: the head gets a namespace of its own too (`head_exec` runs a command there).

Everything is ended in `close`: the sshd's namespace by its own pid (its PID 1 takes the rest with it), the
namespaces and the veth deleted.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from watchdog.config.nodes import NodeSection

_subnet = itertools.count(int.from_bytes(secrets.token_bytes(1), "big") % 200)


def run(argv: list[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{argv}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def keygen(path: Path) -> str:
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)])
    return (path.with_suffix(".pub") if path.suffix else Path(f"{path}.pub")).read_text().strip()


SSHD_CONFIG = """ListenAddress {addr}
Port 22
HostKey {dir}/host_key
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin forced-commands-only
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowTcpForwarding no
X11Forwarding no
PermitTTY no
MaxSessions 64
MaxStartups 64
LogLevel VERBOSE
"""


REAPER = ("import os, time\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n"
          "        time.sleep(0.5)\n")


class HeadNamespace:
    """The head node's own PID and mount namespaces (its /proc holds only the head's processes, as on a real head):
    a reaper as PID 1 with its own /dev/shm (``shm``: the tmpfs's size), the head's network left as this
    process's. `nsenter()` is the prefix of a command run there; `close` ends the whole namespace by its holder's
    process group (its PID 1 takes the rest with it)."""

    def __init__(self, root: Path, shm: str = "512m") -> None:
        self.root, self.shm = root, shm
        self.holder: subprocess.Popen[bytes] | None = None
        self.pid1 = 0

    def start(self) -> HeadNamespace:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "reaper.py").write_text(REAPER)
        boot = (f"mount --make-rprivate / && mount -t tmpfs -o size={self.shm} tmpfs /dev/shm && "
                f"exec {sys.executable} {self.root}/reaper.py")
        self.holder = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", boot],
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            kids = Path(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children").read_text().split()
            if kids:
                self.pid1 = int(kids[0])
                return self
            time.sleep(0.05)
        self.close()
        raise RuntimeError("the head's PID namespace did not start")

    @property
    def started(self) -> bool:
        return self.holder is not None

    def nsenter(self) -> list[str]:
        return ["nsenter", "-t", str(self.pid1), "-p", "-m", "--"]

    def close(self) -> None:
        if self.holder is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.holder.pid, signal.SIGKILL)
            self.holder.wait(timeout=10)
            self.holder = None


class SshNode:
    def __init__(self, root: Path, agent_toml: str = "", head_netns: bool = False, name: str = "worker1",
                 python: str = sys.executable) -> None:
        self.root = root
        self.dir = root / "node"
        self.dir.mkdir(parents=True, exist_ok=True)
        tag = secrets.token_hex(3)
        self.tag = tag
        self.ns = f"wdw-{tag}"
        self.head_ns = f"wdh-{tag}" if head_netns else ""
        sub = next(_subnet)
        self.head_addr, self.addr = f"10.231.{sub}.1", f"10.231.{sub}.2"
        self.veth_head, self.veth_node = f"vh{tag}", f"vw{tag}"
        self.name = name
        self.python = python
        self.agent_config = self.dir / "agent.toml"
        self.agent_config.write_text(agent_toml)
        self.audit_log = self.dir / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.sshd_log = self.dir / "sshd.log"

    # ------------------------------------------------------------------ set-up
    def start(self) -> SshNode:
        d = self.dir
        self.host_pub = keygen(d / "host_key")
        self.client_pub = keygen(d / "client_key")
        self.known_hosts = d / "known_hosts"
        self.known_hosts.write_text(f"{self.addr} {' '.join(self.host_pub.split()[:2])}\n")
        forced = f"{self.python} -m watchdog.nodes.agent --config {self.agent_config}"
        (d / "authorized_keys").write_text(
            f'command="{forced}",no-port-forwarding,no-pty,no-agent-forwarding,no-X11-forwarding,no-user-rc '
            f"{self.client_pub}\n")
        (d / "sshd_config").write_text(SSHD_CONFIG.format(addr=self.addr, dir=d))
        self._net()
        Path("/run/sshd").mkdir(exist_ok=True)
        # PID 1 of the node reaps orphans (a detached engine's processes), sshd runs beside it
        boot = (f"mount --make-rprivate / && mount -t tmpfs -o size=512m tmpfs /dev/shm && "
                f"(/usr/sbin/sshd -D -e -f {d}/sshd_config &) && exec {self.python} {d}/reaper.py")
        (d / "reaper.py").write_text(REAPER)
        with open(self.sshd_log, "ab") as log:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "unshare", "--pid", "--fork", "--mount", "--mount-proc",
                 "sh", "-c", boot], stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if "Server listening" in self.sshd_log.read_text(errors="replace"):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"sshd did not start: {self.sshd_log.read_text(errors='replace')[-2000:]}")

    def _net(self) -> None:
        run(["ip", "netns", "add", self.ns])
        if self.head_ns:
            run(["ip", "netns", "add", self.head_ns])
        run(["ip", "link", "add", self.veth_head, "type", "veth", "peer", "name", self.veth_node])
        run(["ip", "link", "set", self.veth_node, "netns", self.ns])
        if self.head_ns:
            run(["ip", "link", "set", self.veth_head, "netns", self.head_ns])
        self.head_ip(["addr", "add", f"{self.head_addr}/30", "dev", self.veth_head])
        self.head_ip(["link", "set", self.veth_head, "up"])
        self.node_ip(["addr", "add", f"{self.addr}/30", "dev", self.veth_node])
        self.node_ip(["link", "set", self.veth_node, "up"])
        self.node_ip(["link", "set", "lo", "up"])
        if self.head_ns:
            self.head_ip(["link", "set", "lo", "up"])

    def head_ip(self, args: list[str]) -> None:
        run(["ip", "netns", "exec", self.head_ns, "ip", *args] if self.head_ns else ["ip", *args])

    def node_ip(self, args: list[str]) -> None:
        run(["ip", "netns", "exec", self.ns, "ip", *args])

    def link(self, up: bool) -> None:
        """Cut (or restore) the link: the head's end of the veth down (up)."""
        self.head_ip(["link", "set", self.veth_head, "up" if up else "down"])

    @property
    def sshd_pid(self) -> int:
        """The node's PID 1 as this (root) namespace sees it (a reaper; sshd runs beside it)."""
        assert self.proc is not None
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(kids[0])

    def nsenter(self) -> list[str]:
        """Prefix for a command inside the node (its network, PID and mount namespaces)."""
        return ["nsenter", "-t", str(self.sshd_pid), "-p", "-m", "-n", "--"]

    def section(self, **over: object) -> NodeSection:
        values: dict[str, object] = {"name": self.name, "host": self.addr, "user": "root",
                                     "identity_file": str(self.dir / "client_key"),
                                     "known_hosts_file": str(self.known_hosts), "connect_timeout": 3.0,
                                     "call_timeout": 20.0}
        values.update(over)
        return NodeSection(**values)  # type: ignore[arg-type]

    def toml(self) -> str:
        return (f'[[nodes]]\nname = "{self.name}"\nhost = "{self.addr}"\nidentity_file = "{self.dir}/client_key"\n'
                f'known_hosts_file = "{self.known_hosts}"\nconnect_timeout = 3.0\n')

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            self.proc = None
        for ns in (self.ns, self.head_ns):
            if ns:
                run(["ip", "netns", "del", ns], check=False)
        run(["ip", "link", "del", self.veth_head], check=False)  # when its end stayed here

    def __enter__(self) -> SshNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
