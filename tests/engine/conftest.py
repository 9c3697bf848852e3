"""Fixtures that run a real vLLM (CPU build, TP=2) for the engine tests.

    engine_python: Path                       the engine venv's python (installed once if missing)
    fast_model / slow_model: Path             tiny random-weight models, generated once per machine
    vllm(model=None, *, wait=True, ready_timeout=240.0, **opts) -> VllmServer
                                              started, and ready unless wait=False (then call
                                              server.wait_ready(timeout) yourself); `opts` go to VllmServer (e.g.
                                              max_num_batched_tokens=8192, max_model_len=8192,
                                              extra_args=[...], env={...}); model defaults to the fast one

Every server the `vllm` factory started is stopped in teardown, whether the test passed or not; a failed
test gets the servers' log tails in its report. One vLLM at a time: the machine has 2 cores.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import engine_env, models
from tests.harness.server import VllmFactory, VllmServer
from tests.harness.watcher import WatchdogProcess, quick_config


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture(scope="session")
def engine_python() -> Path:
    return engine_env.engine_python()


@pytest.fixture(scope="session")
def fast_model(engine_python: Path) -> Path:
    return models.ensure_model(models.FAST, engine_python)


@pytest.fixture(scope="session")
def slow_model(engine_python: Path) -> Path:
    return models.ensure_model(models.SLOW, engine_python)


@pytest.fixture
def vllm(request: pytest.FixtureRequest, engine_python: Path, tmp_path: Path) -> Iterator[VllmFactory]:
    servers: list[VllmServer] = []

    def start(model: Path | None = None, *, wait: bool = True, ready_timeout: float = 240.0, **opts: Any) -> VllmServer:
        if any(s.is_alive() for s in servers):
            raise RuntimeError("one vLLM at a time (2 cores): stop() the previous server first")
        server = VllmServer(
            engine_python,
            model or models.ensure_model(models.FAST, engine_python),
            tmp_path / "logs",
            name=opts.pop("name", f"vllm-{len(servers)}"),
            **opts,
        )
        servers.append(server)  # before start(): teardown must stop it even if start or readiness fails
        server.start()
        if wait:
            server.wait_ready(ready_timeout)
        return server

    yield start

    failed = any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False) for w in ("setup", "call"))
    errors: list[str] = []
    for server in servers:
        if failed:
            print(f"--- {server.name} ({server.log_path}), last lines ---\n{server.log_tail(80)}")
        try:
            server.stop()
        except Exception as exc:  # keep stopping the others
            errors.append(f"{server.name}: {exc}")
    if errors:
        pytest.fail("could not stop every vLLM: " + "; ".join(errors))


@pytest.fixture
def watch(tmp_path: Path) -> Iterator[Callable[..., WatchdogProcess]]:
    """watch(url, suspect=5, window=15, probe=10, extra="") -> a running `watchdog run`, stopped in teardown."""
    started: list[WatchdogProcess] = []

    def start(url: str, suspect: float = 5.0, window: float = 15.0, probe: float = 10.0,
              extra: str = "") -> WatchdogProcess:
        w = WatchdogProcess(url, tmp_path / f"watchdog-{len(started)}", quick_config(suspect, window, probe, extra))
        started.append(w.start())
        return w

    yield start
    for w in started:
        w.stop()
