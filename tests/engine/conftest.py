"""Fixtures that run a real vLLM (CPU build, TP=2) for the engine tests.

    engine_python: Path                       the engine venv's python (installed once if missing)
    fast_model / slow_model: Path             tiny random-weight models, generated once per machine
    shared_vllm: VllmServer                   the session's shared fast server, proven healthy and quiet (a real
                                              generation) before each test; for tests that leave it as they
                                              found it (read, load, or freeze and continue a process)
    vllm(model=None, *, wait=True, ready_timeout=240.0, **opts) -> VllmServer
                                              started, and ready unless wait=False (then call
                                              server.wait_ready(timeout) yourself); `opts` go to VllmServer (e.g.
                                              max_num_batched_tokens=8192, max_model_len=8192,
                                              extra_args=[...], env={...}); model defaults to the fast one

Every server the `vllm` factory started is stopped in teardown, whether the test passed or not; a failed
test gets the servers' log tails in its report. One vLLM at a time: the machine has 2 cores. The shared server is
stopped before the set-up of any engine test that does not use it (so before it can start a server of its own,
a module-scoped fixture included), and at the end of the session; a test that fails with it, or leaves one of
its processes stopped, has it stopped too. tests/conftest.py orders the engine tests so that those using the
shared server run together (and those that end it, marked `ends_shared_server`, last among them).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import engine_env, models
from tests.harness.server import VllmFactory, VllmServer
from tests.harness.shared_server import SharedVllm
from tests.harness.watcher import WatchdogProcess, quick_config

_shared: list[SharedVllm] = []  # the session's pool, once a test has asked for the shared server


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """One vLLM at a time: stop the shared server before a test that does not use it sets anything up."""
    if "shared_vllm" not in getattr(item, "fixturenames", ()):
        for pool in _shared:
            pool.release()


def failed(node: pytest.Item) -> bool:
    return any(getattr(getattr(node, f"rep_{w}", None), "failed", False) for w in ("setup", "call"))


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


@pytest.fixture(scope="session")
def shared_vllm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedVllm]:
    pool = SharedVllm(tmp_path_factory.mktemp("shared-vllm"))
    _shared.append(pool)
    try:
        yield pool
    finally:
        _shared.remove(pool)
        pool.release()
        _summary.append(f"shared vLLM: {pool.handed_out} tests served by {pool.started} servers"
                        + "".join(f"\n  not reused: {why}" for why in pool.replaced))


_summary: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _summary:
        terminalreporter.write_line(line)


@pytest.fixture
def shared_vllm(request: pytest.FixtureRequest, shared_vllm_pool: SharedVllm, engine_python: Path,
                fast_model: Path) -> Iterator[VllmServer]:
    server = shared_vllm_pool.acquire(engine_python, fast_model)
    yield server
    if failed(request.node):
        print(f"--- {server.name} (shared, {server.log_path}), last lines ---\n{server.log_tail(80)}")
    if failed(request.node) or shared_vllm_pool.has_stopped_process():
        shared_vllm_pool.release()  # a stopped process is continued (then ended) by stop()


@pytest.fixture
def vllm(request: pytest.FixtureRequest, engine_python: Path, tmp_path: Path) -> Iterator[VllmFactory]:
    servers: list[VllmServer] = []

    def start(model: Path | None = None, *, wait: bool = True, ready_timeout: float = 240.0, **opts: Any) -> VllmServer:
        if any(s.is_alive() for s in servers):
            raise RuntimeError("one vLLM at a time (2 cores): stop() the previous server first")
        for pool in _shared:
            pool.release()
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

    errors: list[str] = []
    for server in servers:
        if failed(request.node):
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
