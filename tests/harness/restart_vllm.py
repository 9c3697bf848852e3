"""A restart command for the watchdog's ``command`` strategy in tests: stop the vLLM whose process group is in a
pid file, start a new one in a session of its own, write its pid, exit (readiness is the watchdog's to prove).

    python tests/harness/restart_vllm.py --pidfile F --python ENGINE_PY --model DIR --port P --log-dir D [--stop-only]
        [--tensor-parallel-size N] [--data-parallel-size N] [--inject FLAG]

The tests start the first server with this same script, so every server is an orphan of it (reaped by init),
and a stopped group can be told gone. `stop_group` is what their teardown calls too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.harness.inject import injected_env
from tests.harness.server import VllmServer, free_port


def group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _signal(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stop_group(pgid: int, term_timeout: float = 20.0) -> None:
    """SIGCONT (a stopped worker cannot act on SIGTERM), SIGTERM, bounded wait, then SIGKILL the group."""
    if not group_members(pgid):
        return
    _signal(pgid, signal.SIGCONT)
    _signal(pgid, signal.SIGTERM)
    if not _wait_gone(pgid, term_timeout):
        _signal(pgid, signal.SIGCONT)
        _signal(pgid, signal.SIGKILL)
        if not _wait_gone(pgid, 15.0):
            raise RuntimeError(f"process group {pgid} still alive after SIGKILL")


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class ScriptedServer:
    """A vLLM started and restarted only by the restart script, as the watchdog's command strategy will."""

    def __init__(self, engine_python: Path, model: Path, tmp: Path, tensor_parallel_size: int = 2,
                 inject: Path | None = None, data_parallel_size: int = 1) -> None:
        """``inject``: the flag file of the tests' fault injection, loaded by every server this script starts."""
        self.port, self.model = free_port(), model
        self.pidfile, self.log_dir = tmp / "vllm.pid", tmp / "logs"
        self.argv = [sys.executable, str(Path(__file__).resolve()), "--pidfile", str(self.pidfile),
                     "--python", str(engine_python), "--model", str(model), "--port", str(self.port),
                     "--log-dir", str(self.log_dir)]
        if tensor_parallel_size != 2:
            self.argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if data_parallel_size != 1:
            self.argv += ["--data-parallel-size", str(data_parallel_size)]
        if inject is not None:
            self.argv += ["--inject", str(inject)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.log_dir / f"vllm-{self.port}.log"  # every server's, appended: one life after another

    def run_script(self, *extra: str) -> None:
        subprocess.run([*self.argv, *extra], check=True, timeout=120, capture_output=True, start_new_session=True)

    @property
    def pid(self) -> int:
        pid = read_pid(self.pidfile)
        assert pid is not None
        return pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = requests.post(f"{self.url}/v1/completions", timeout=15,
                                  json={"model": self.model.name, "prompt": "ready", "max_tokens": 1})
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise AssertionError(f"vLLM not ready in {timeout}s:\n{self.log_tail()}")

    def process(self, title: str) -> psutil.Process:
        root = psutil.Process(self.pid)
        for p in [root, *root.children(recursive=True)]:
            if title in " ".join(p.cmdline()) or p.name() == title:
                return p
        raise AssertionError(f"no {title} process under pid {self.pid}")

    def log_tail(self, n: int = 40) -> str:
        logs = sorted(self.log_dir.glob("*.log"))
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-n:]) if logs else ""



def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("--pidfile", "--python", "--model", "--log-dir"):
        ap.add_argument(name, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=2)  # 1: still a VLLM::Worker (mp executor)
    ap.add_argument("--data-parallel-size", type=int, default=1)  # N engines on one page (EngineCore_DP<n>)
    ap.add_argument("--stop-only", action="store_true")
    ap.add_argument("--inject", help="the fault injection's flag file (tests/harness/inject)")
    a = ap.parse_args()
    pidfile = Path(a.pidfile)
    old = read_pid(pidfile)
    if old is not None:
        stop_group(old)
        print(f"stopped vLLM process group {old}", flush=True)
    if a.stop_only:
        return 0
    server = VllmServer(Path(a.python), Path(a.model), Path(a.log_dir), port=a.port, name=f"vllm-{a.port}",
                        tensor_parallel_size=a.tensor_parallel_size,
                        extra_args=["--data-parallel-size", str(a.data_parallel_size)] if a.data_parallel_size > 1
                        else (),
                        env=injected_env(Path(a.inject)) if a.inject else None)
    server.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(server.log_path, "ab") as log:
        p = subprocess.Popen(server.args, env=server.env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, cwd=server.log_path.parent)
    tmp = pidfile.with_suffix(".tmp")
    tmp.write_text(f"{p.pid}\n")
    os.replace(tmp, pidfile)
    print(f"started vLLM pid {p.pid} on port {a.port}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
