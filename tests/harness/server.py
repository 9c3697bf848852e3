"""Start, inspect and stop one real vLLM (CPU build, TP=2) for a test.

The server runs in its own session (its pid is the session id and the process group id). This object
never reaps that root process before `stop()` has ended everything else, so the ids cannot be reused by
some other process meanwhile: every signal it sends goes only to processes it started.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import psutil
import requests

from tests.harness.metrics import watched

ROOT_TITLE = "api_server"
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


class ServerExited(RuntimeError):
    """The server's root process exited while we waited for it."""


def wait_running(url: str, at_least: int = 1, timeout: float = 60.0) -> float:
    """Wait until the page shows `at_least` requests running (load has reached the engine); return that count."""
    deadline = time.monotonic() + timeout
    running = 0.0
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            r = requests.get(f"{url}/metrics", timeout=5)
            running = watched(r.text).get("vllm:num_requests_running", 0.0) if r.ok else 0.0
            if running >= at_least:
                return running
        time.sleep(0.2)
    raise TimeoutError(f"{url}: {running:.0f} requests running after {timeout:.0f} s, wanted {at_least}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` from the engine venv, TP=2 by default.

    `extra_args` are appended to the command line (later flags win in argparse); `env` overrides
    the environment (a value of None removes the variable).
    """

    def __init__(
        self,
        python: Path,
        model: Path,
        log_dir: Path,
        *,
        tensor_parallel_size: int = 2,
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        name: str | None = None,
    ) -> None:
        self.python = Path(python)
        self.model = Path(model)
        self.model_name = served_model_name or self.model.name
        self.host = host
        self.port = port or free_port(host)
        self.name = name or f"vllm-{self.model_name}-{self.port}"
        self.log_path = Path(log_dir) / f"{self.name}.log"
        self.args: list[str] = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.model_name,
            "--host", host,
            "--port", str(self.port),
            "--tensor-parallel-size", str(tensor_parallel_size),
            "--distributed-executor-backend", "mp",
            "--enforce-eager",
            "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--disable-uvicorn-access-log",
            *extra_args,
        ]  # fmt: skip
        self.env = self._environment(env or {})
        self.started_at: float | None = None  # time.monotonic() at spawn
        self.ready_after: float | None = None  # seconds from spawn to first successful completion
        self._popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._known: dict[int, psutil.Process] = {}
        self._stopped = False

    # ----------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The API server's pid, which is also the session id and process group id."""
        if self._popen is None:
            raise RuntimeError("server not started")
        return self._popen.pid

    def start(self) -> VllmServer:
        if self._popen is not None:
            raise RuntimeError("already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.started_at = time.monotonic()
        self._popen = subprocess.Popen(
            self.args,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.log_path.parent,
        )
        self._known[self._popen.pid] = psutil.Process(self._popen.pid)
        return self

    def exit_code(self) -> int | None:
        """The root's exit status if it has exited, else None. Does not reap it (see module doc)."""
        if self._popen is None:
            return None
        if self._popen.returncode is not None:
            return self._popen.returncode
        try:
            info = os.waitid(os.P_PID, self._popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self._popen.poll()
        if info is None:
            return None
        return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status

    def is_alive(self) -> bool:
        return self._popen is not None and self.exit_code() is None

    def wait_ready(self, timeout: float = 180.0) -> float:
        """Wait until a real completion (max_tokens=1) succeeds; return seconds since spawn."""
        if self._popen is None or self.started_at is None:
            raise RuntimeError("server not started")
        deadline = time.monotonic() + timeout
        last_error = "no attempt yet"
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise ServerExited(
                    f"{self.name} exited with {code} before it was ready; log tail:\n{self.log_tail(60)}"
                )
            try:
                r = requests.post(
                    f"{self.url}/v1/completions",
                    json={"model": self.model_name, "prompt": "ready", "max_tokens": 1},
                    timeout=max(1.0, min(15.0, deadline - time.monotonic())),
                )
                if r.status_code == 200:
                    self.ready_after = time.monotonic() - self.started_at
                    return self.ready_after
                last_error = f"HTTP {r.status_code}: {r.text[:200]}"
            except requests.RequestException as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise TimeoutError(
            f"{self.name} not ready after {timeout:.0f} s (last: {last_error}); log tail:\n{self.log_tail(60)}"
        )

    def stop(self, term_timeout: float = 30.0, kill_timeout: float = 15.0) -> None:
        """End every process of this server's session. Idempotent; safe if some or all are dead.

        SIGCONT to stopped ones first (a stopped process cannot act on SIGTERM), then SIGTERM to the
        process group, a bounded wait, then SIGKILL to the group and to any member that left it.
        """
        if self._popen is None or self._stopped:
            return
        try:
            self._signal_all(signal.SIGCONT)
            self._signal_all(signal.SIGTERM)
            if not self._wait_all_gone(term_timeout):
                self._signal_all(signal.SIGCONT)
                self._signal_all(signal.SIGKILL)
                if not self._wait_all_gone(kill_timeout):
                    left = ", ".join(f"{p.pid}" for p in self.session_processes())
                    raise RuntimeError(f"{self.name}: processes still alive after SIGKILL: {left}")
        finally:
            if not self.session_processes():
                self._popen.wait(timeout=kill_timeout)  # reap the root only once the session is empty
                self._stopped = True
                self._remove_leftovers()
            if self._log is not None:
                self._log.close()
                self._log = None

    def __enter__(self) -> VllmServer:
        if self._popen is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------- inspection

    def session_processes(self) -> list[psutil.Process]:
        """Live (non-zombie) processes of this server's session, the root included while it runs."""
        if self._popen is None:
            return []
        sid = self._popen.pid
        if self._popen.returncode is None:  # root unreaped: sid is ours alone, scan for newcomers
            for proc in psutil.process_iter():
                try:
                    if os.getsid(proc.pid) == sid and proc.pid not in self._known:
                        self._known[proc.pid] = proc
                except (ProcessLookupError, PermissionError, psutil.Error):
                    continue
        live = []
        for pid, proc in list(self._known.items()):
            try:
                # is_running() compares create times, so a reused pid is never taken for ours
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    live.append(proc)
                    continue
            except psutil.NoSuchProcess:
                pass
            del self._known[pid]
        return live

    def processes(self) -> dict[str, psutil.Process]:
        """Session processes by title: "api_server" (the root), "VLLM::EngineCore", "VLLM::Worker_TP0", ...

        Titles are read from /proc/PID/cmdline (comm is cut to 15 characters). Processes without a
        `VLLM::` title other than the root (e.g. multiprocessing's resource tracker) are left out.
        """
        return titled(self.pid, self.session_processes())

    def process(self, title: str) -> psutil.Process:
        return one_titled(self.processes(), title)

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 256 * 1024))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-n:])

    def metrics(self, timeout: float = 5.0) -> str:
        r = requests.get(f"{self.url}/metrics", timeout=timeout)
        r.raise_for_status()
        return r.text

    def wait_running(self, at_least: int = 1, timeout: float = 60.0) -> float:
        return wait_running(self.url, at_least, timeout)

    def complete(self, prompt: str, max_tokens: int = 16, timeout: float = 120.0, **extra: Any) -> Any:
        """One blocking /v1/completions call; returns the decoded JSON body (raises on HTTP errors)."""
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, **extra}
        r = requests.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    # ----------------------------------------------------------------- internals

    @staticmethod
    def _environment(overrides: Mapping[str, str | None]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        env.update(BASE_ENV)
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def _signal_all(self, sig: signal.Signals) -> None:
        assert self._popen is not None
        members = self.session_processes()  # also records newcomers while the root is unreaped
        pgid = self._popen.pid
        if self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)  # the group id is the unreaped root's pid: ours alone
        for proc in members:  # members that left the group (or all of them, once the root is reaped)
            try:
                if self._popen.returncode is None and os.getpgid(proc.pid) == pgid:
                    continue  # already signalled through the group: never deliver a signal twice
                proc.send_signal(sig)  # psutil refuses a pid that was reused
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass

    def _remove_leftovers(self) -> None:
        """Delete the files vLLM leaves behind for this server's run (named after its own random id).

        The CPU all-reduce's shared memory (/dev/shm/vllm_dist_<id>-tp:...-cpushm_<rank>, 8 MiB per rank)
        and the rendezvous file /tmp/vllm_dist_<id> are never removed by vLLM 0.32, even on a clean stop.
        """
        for dist_id in set(re.findall(r"vllm_dist_[0-9a-f]{32}", self.log_tail(100_000))):
            for path in [*Path("/dev/shm").glob(f"{dist_id}-*"), Path(tempfile.gettempdir()) / dist_id]:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _wait_all_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.session_processes():
                return True
            time.sleep(0.2)
        return not self.session_processes()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("running" if self.is_alive() else "not running")
        return f"<VllmServer {self.name} {self.url} {state}>"


# The type of the `vllm` fixture (tests/engine/conftest.py): vllm(model=None, *, ready_timeout, **opts).
VllmFactory = Callable[..., VllmServer]


def titled(root: int | None, procs: list[psutil.Process]) -> dict[str, psutil.Process]:
    """An engine's processes by title: ``root`` as "api_server", the others by their ``VLLM::`` title (read from the
    command line: comm is cut to 15 characters); untitled ones (multiprocessing's resource tracker) left out."""
    found: dict[str, psutil.Process] = {}
    for proc in procs:
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if proc.pid == root:
            found[ROOT_TITLE] = proc
        elif cmdline and cmdline[0].startswith("VLLM::"):
            found.setdefault(cmdline[0].strip(), proc)
    return found


def one_titled(procs: dict[str, psutil.Process], title: str) -> psutil.Process:
    if title not in procs:
        raise KeyError(f"{title!r} not among {sorted(procs)}")
    return procs[title]
