"""Fixtures shared by every test directory."""

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests.receiver import receiver  # noqa: F401  (a fixture: a real HTTP receiver on loopback)


@pytest.fixture
def daemon_proc() -> Iterator[list[subprocess.Popen[str]]]:
    """Daemons a test starts (each in its own session); any still running is killed by its own group in teardown."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
