"""Many nodes behind one head: N `SshNode`s (each its own network, PID and mount namespaces, a real sshd whose only
key runs the real agent), and on each, R stand-in ranks (`stand_in_rank.py`: real Python processes titled
``VLLM::Worker_TP<n>``, waiting in a ZMQ poll). Node k is ``node<k>`` and holds ranks k*R .. k*R+R-1, as a
tensor-parallel engine spread over N nodes numbers them.

The head is a PID and mount namespace of its own (`HeadNamespace`: from this one every node's processes are in
/proc; the head's must not see them) in this process's network: the test runs ``watchdog run`` or ``watchdog dump``
there (`head_nsenter()`), with `toml()` as its ``[[nodes]]``. Everything is ended in `close`: each rank by its own
process group (a stopped one is continued first), each node (`SshNode.close`), then the head's namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.harness.sshnode import HeadNamespace, SshNode

STAND_IN = Path(__file__).with_name("stand_in_rank.py")


class Rank:
    """One stand-in rank: the nsenter that started it (its process group) and the rank itself."""

    def __init__(self, node: SshNode, rank: int, socket_dir: Path, log: Path) -> None:
        self.node, self.rank, self.log = node, rank, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([*node.nsenter(), sys.executable, str(STAND_IN), str(rank), str(socket_dir)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        self.stopped = False

    @property
    def title(self) -> str:
        return f"VLLM::Worker_TP{self.rank}"

    @property
    def ready(self) -> bool:
        return self.log.exists() and "ready" in self.log.read_text(errors="replace")

    @property
    def pid(self) -> int:
        """The rank's pid as this (the root) namespace sees it: nsenter's child."""
        return int(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()[0])

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        if self.stopped:
            with contextlib.suppress(ProcessLookupError, OSError, IndexError, ValueError):
                os.kill(self.pid, signal.SIGCONT)
            self.stopped = False

    def close(self) -> None:
        self.cont()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


class Cluster:
    def __init__(self, root: Path, nodes: int, ranks: int, agent_toml: str = "") -> None:
        """``agent_toml``: more of every node's agent config (its [[steps]])."""
        self.root, self.count, self.per_node, self.agent_toml = root, nodes, ranks, agent_toml
        self.nodes: list[SshNode] = []
        self.ranks: list[Rank] = []
        self.socket_dir = Path(tempfile.mkdtemp(prefix="ewr-"))  # short: an ipc:// path is at most 107 bytes
        self.head = HeadNamespace(root / "head")

    def start(self, timeout: float = 60.0) -> Cluster:
        try:
            self.head.start()
            for k in range(self.count):
                d = self.root / f"node{k}"
                self.nodes.append(SshNode(d, f'audit_log = "{d}/node/agent.log"\n{self.agent_toml}', name=f"node{k}"))
            with ThreadPoolExecutor(max_workers=self.count) as pool:  # sshd and keys per node: in parallel
                list(pool.map(SshNode.start, self.nodes))
            for k, node in enumerate(self.nodes):
                for r in range(k * self.per_node, (k + 1) * self.per_node):
                    self.ranks.append(Rank(node, r, self.socket_dir, node.dir / f"rank-{r}.log"))
            deadline = time.monotonic() + timeout
            while not all(r.ready for r in self.ranks):
                dead = [r for r in self.ranks if r.proc.poll() is not None]
                if dead or time.monotonic() > deadline:
                    r = (dead or [r for r in self.ranks if not r.ready])[0]
                    raise RuntimeError(f"rank {r.rank} on {r.node.name} did not start: "
                                       f"{r.log.read_text(errors='replace')[-1500:]}")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def rank(self, n: int) -> Rank:
        return self.ranks[n]

    def head_nsenter(self) -> list[str]:
        return self.head.nsenter()

    def toml(self) -> str:
        return "".join(n.toml() for n in self.nodes)

    def close(self) -> None:
        """Everything, each part even when an earlier one failed to end (the first error is raised at the end)."""
        errors: list[BaseException] = []
        for part in [*self.ranks, *self.nodes, self.head]:
            try:
                part.close()
            except Exception as e:  # the rest must still be ended
                errors.append(e)
        self.ranks.clear()
        self.nodes.clear()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
