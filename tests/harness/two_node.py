"""A real two-node vLLM (CPU, TP=2) on one machine, the way it runs on two hosts.

- the worker node: `SshNode` (its own network, PID and mount namespaces, a real sshd, its own /dev/shm);
- the head: its own PID and mount namespaces (so its /proc, and a watchdog started in it, sees only the head's
  processes) with its own /dev/shm (a tmpfs: a restart may remove the stale segments there without touching the
  machine's), in this network namespace, joined to the worker by the veth pair; `HeadWatchdog` runs
  `watchdog run` in it;
- head: ``vllm serve --nnodes 2 --node-rank 0 --master-addr <head address>`` (API server, EngineCore,
  Worker_TP0); worker: ``--node-rank 1 --headless`` (a plain parent and Worker_TP1, no HTTP); both with
  GLOO_SOCKET_IFNAME and VLLM_HOST_IP of their end of the veth.

Each half is started and stopped by `two_node_ctl.py` (as a unit would be), so restart steps can do the same.
`close` stops both halves and then ends both namespaces by their PID 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests

from tests.harness.server import BASE_ENV, free_port
from tests.harness.sshnode import HeadNamespace, SshNode
from tests.harness.watcher import WatchdogProcess
from watchdog.act.state import load_status

HERE = Path(__file__).resolve().parent
CTL = HERE / "two_node_ctl.py"
SERVE = HERE / "vllm_serve_main.py"


class TwoNodeVllm:
    def __init__(self, root: Path, engine_python: Path, model: Path, node: SshNode,
                 env: dict[str, str] | None = None) -> None:
        self.root, self.python, self.model, self.node = root, engine_python, model, node
        self.extra_env = env or {}  # for both halves (e.g. the tests' fault injection)
        self.run = root / "run"
        self.run.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_name = model.name
        self.head = HeadNamespace(self.run, shm="2g")

    def _spec(self, role: str) -> None:
        n = self.node
        common = [str(self.python), str(SERVE), str(self.model), "--served-model-name", self.model_name,
                  "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--enforce-eager",
                  "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "256", "--nnodes", "2", "--master-addr", n.head_addr]
        if role == "head":
            argv = [*common, "--node-rank", "0", "--host", "127.0.0.1", "--port", str(self.port),
                    "--disable-uvicorn-access-log"]
            env = {"GLOO_SOCKET_IFNAME": n.veth_head, "VLLM_HOST_IP": n.head_addr}
        else:
            argv = [*common, "--node-rank", "1", "--headless"]
            env = {"GLOO_SOCKET_IFNAME": n.veth_node, "VLLM_HOST_IP": n.addr}
        spec = {"argv": argv, "env": {**BASE_ENV, **env, **self.extra_env}, "log": str(self.run / f"{role}.log")}
        (self.run / f"{role}.json").write_text(json.dumps(spec))

    def start_head_namespace(self) -> None:
        self.head.start()

    @property
    def head_pid1(self) -> int:
        return self.head.pid1

    def head_nsenter(self) -> list[str]:
        return self.head.nsenter()

    def ctl(self, verb: str, role: str) -> list[str]:
        """The argv of a step that starts or stops one half (run on that half's node)."""
        return [sys.executable, str(CTL), verb, role, str(self.run)]

    def do(self, verb: str, role: str) -> None:
        prefix = self.head_nsenter() if role == "head" else self.node.nsenter()
        subprocess.run([*prefix, *self.ctl(verb, role)], check=True, timeout=60)

    def start(self, ready_timeout: float = 300.0) -> TwoNodeVllm:
        self._spec("head")
        self._spec("worker")
        if not self.head.started:
            self.start_head_namespace()
        self.do("start", "worker")
        self.do("start", "head")
        self.wait_ready(ready_timeout)
        return self

    def generate(self, timeout: float = 30.0) -> str:
        r = requests.post(f"{self.url}/v1/completions", json={"model": self.model_name, "prompt": "hello",
                                                              "max_tokens": 4}, timeout=timeout)
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(requests.RequestException):
                self.generate(10)
                return time.monotonic() - t0
            time.sleep(1)
        raise TimeoutError(f"the two-node vLLM did not serve within {timeout:.0f}s; head log: "
                           f"{self.log_tail('head')}\nworker log: {self.log_tail('worker')}")

    def log_tail(self, role: str, n: int = 3000) -> str:
        p = self.run / f"{role}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def pids(self, role: str) -> dict[str, int]:
        """Title -> pid as this (root) namespace sees them, of one half's processes."""
        pidfile = self.run / f"{role}.pid"
        holder_view = int(pidfile.read_text())  # the pid inside that half's namespace
        ns_pid1 = self.head_pid1 if role == "head" else self.node.sshd_pid
        out: dict[str, int] = {}
        ns = os.readlink(f"/proc/{ns_pid1}/ns/pid")
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.readlink(d / "ns/pid") != ns:
                    continue
                status = (d / "status").read_text()
                nspid = next(ln.split()[-1] for ln in status.splitlines() if ln.startswith("NSpid:"))
                title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                if title.startswith("VLLM::") or int(nspid) == holder_view:
                    out[title if title.startswith("VLLM::") else "root"] = int(d.name)
        return out

    def close(self) -> None:
        for role in ("head", "worker"):
            with contextlib.suppress(Exception):
                self.do("stop", role)
        self.head.close()


class HeadWatchdog(WatchdogProcess):
    """`python -m watchdog run` in the head's PID and mount namespaces (as on a real head node: its /proc holds
    only the head's processes), in a session of its own; ended by its process group (nsenter and the daemon)."""

    def __init__(self, url: str, head_nsenter: list[str], state_dir: Path, config_text: str) -> None:
        super().__init__(url, state_dir, config_text)
        self.prefix = head_nsenter

    def start(self) -> HeadWatchdog:
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "watchdog", "run", "--url", self.url, "--state-dir",
                 str(self.state_dir), "--config", str(self.config), "--metrics-port", "0"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at = time.time()
        return self

    def status(self) -> dict[str, object]:
        try:
            return load_status(self.state_dir, time.time()) or {}
        except (OSError, ValueError):
            return {}

    def wait_for(self, what: str, probe: Callable[[], Any], timeout: float) -> Any:
        """probe()'s first true answer within ``timeout`` s (polled every 0.2 s); else an AssertionError with the
        events, the engines' status and the log's tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = probe()
            if got:
                return got
            time.sleep(0.2)
        raise AssertionError(f"{what}: not within {timeout:.0f}s; events: {[e['event'] for e in self.events()]}; "
                             f"status: {self.status().get('engines')}\n{self.log_tail(40)}")

    def stop(self) -> int | None:
        p = self._popen
        if p is None:
            return None
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        return p.returncode


@contextlib.contextmanager
def running_pair(root: Path, engine_python: Path, model: Path, agent_toml: str,
                 env: dict[str, str] | None = None) -> Iterator[TwoNodeVllm]:
    """A worker node with the given agent config and the pair started on it; both ended on the way out."""
    node = SshNode(root, agent_toml).start()
    pair = TwoNodeVllm(root, engine_python, model, node, env)
    try:
        pair.start()
        yield pair
    finally:
        pair.close()
        node.close()
