"""Fixtures shared by every test directory, and the order the suite runs in."""

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.receiver import receiver  # noqa: F401  (a fixture: a real HTTP receiver on loopback)
from watchdog.cli.config import CONFIG_ENV

# No test's `watchdog` verb reads a config of the host's: a real /etc/engine-watchdog/config.toml (its restart steps,
# its nodes) must never reach a test. /dev/null is the built-in defaults; a test that gives --config or its own
# ENGINE_WATCHDOG_CONFIG still reads that one. Subprocesses (the harness's watchdogs, the demo) inherit it.
os.environ[CONFIG_ENV] = os.devnull

ENGINE_TESTS = Path(__file__).resolve().parent / "engine"
PHASE_NAMES = {0: "unit tests", 1: "install tests"}  # the rest: "engine tests"


def run_order(item: pytest.Item) -> int:
    """Fast tests first, so a failure shows in minutes, not after half an hour of real vLLMs:

    0. everything outside tests/engine without the `engine` or `install` marker (unit tests, fakes, recorded pages:
       seconds);
    1. the install tests (`install`: the release installed into clean Debian roots, a minute each);
    2. engine tests on the shared vLLM that leave it as they found it;
    3. engine tests that take the shared vLLM and end it (`ends_shared_server`);
    4. every other engine test (a vLLM of its own, a throwaway systemd, ...): the shared server is stopped first.
    """
    if item.get_closest_marker("install") is not None:
        return 1
    if item.get_closest_marker("engine") is None and not item.path.is_relative_to(ENGINE_TESTS):
        return 0
    if "shared_vllm" in getattr(item, "fixturenames", ()):
        return 3 if item.get_closest_marker("ends_shared_server") else 2
    return 4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=run_order)  # stable: within a group, the files' own order


# Wall time of each phase of the one pytest run: [first start, last end, tests]. ./scripts/test prints them.
PHASES_FILE_ENV = "WATCHDOG_TEST_PHASES_FILE"
_phases: dict[str, list[float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    name = PHASE_NAMES.get(run_order(item), "engine tests")
    began = time.time()
    yield  # set-up, call and teardown (a session fixture's teardown included, with the last test)
    span = _phases.setdefault(name, [began, began, 0])
    span[1], span[2] = time.time(), span[2] + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _phases:
        return
    terminalreporter.write_line("phases: " + ", ".join(
        f"{name} {end - began:.0f} s ({count:.0f} tests)" for name, (began, end, count) in _phases.items()))
    out = os.environ.get(PHASES_FILE_ENV)
    if out:
        Path(out).write_text(json.dumps({name: {"seconds": round(end - began, 1), "tests": int(count)}
                                         for name, (began, end, count) in _phases.items()}))


@pytest.fixture
def daemon_proc() -> Iterator[list[subprocess.Popen[str]]]:
    """Daemons a test starts (each in its own session); any still running is killed by its own group in teardown."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture
def groups() -> Iterator[list[int]]:
    """Process-group ids a test's commands wrote down; each group is killed at teardown by its own id."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
