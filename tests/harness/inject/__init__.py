"""Fault injection loaded by the engine itself (sitecustomize.py on PYTHONPATH; the faults in watchdog_inject.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.harness.metrics import watched
from tests.harness.server import VllmServer

INJECT_DIR = Path(__file__).resolve().parent
ENV = "WATCHDOG_TEST_INJECT"


def injected_env(flag: Path) -> dict[str, str | None]:
    """VllmServer env overrides that load the injection, switched by the content of ``flag`` (see watchdog_inject)."""
    return {"PYTHONPATH": str(INJECT_DIR), ENV: str(flag)}


@dataclass
class Injected:
    server: VllmServer
    flag: Path

    def fault(self, mode: str) -> None:
        self.flag.write_text(mode)
        time.sleep(0.5)  # the engine re-reads the flag at most every 0.2 s

    def page(self) -> tuple[float, float]:
        p = watched(self.server.metrics())
        return p.get("vllm:num_requests_running", 0.0), p.get("vllm:num_requests_waiting", 0.0)

    def wait_page(self, ok: Callable[[float, float], bool], what: str, timeout: float = 60.0) -> tuple[float, float]:
        deadline = time.monotonic() + timeout
        seen = (-1.0, -1.0)
        while time.monotonic() < deadline:
            try:
                seen = self.page()
            except requests.RequestException:
                pass
            else:
                if ok(*seen):
                    return seen
            time.sleep(0.2)
        raise AssertionError(f"page never showed {what} in {timeout:.0f} s (last running, waiting: {seen});\n"
                             f"{self.server.log_tail(40)}")


@contextlib.contextmanager
def injected_vllm(python: Path, model: Path, d: Path, name: str) -> Iterator[Injected]:
    """A vLLM (the given venv's) with the injection loaded, inert until the flag file names a fault; ready, and
    stopped on the way out with the flag cleared."""
    flag = d / "fault"
    flag.write_text("")
    server = VllmServer(python, model, d / "logs", name=name, env=injected_env(flag))
    try:
        server.start()
        server.wait_ready(300)
        assert "watchdog_inject: patched" in server.log_tail(400), f"injection not loaded from {INJECT_DIR}"
        yield Injected(server, flag)
    finally:
        flag.write_text("")
        server.stop()
