"""Faults for a real engine's processes: freeze (SIGSTOP, always undone) and kill (SIGKILL)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress

import psutil


@contextmanager
def frozen(proc: psutil.Process) -> Iterator[psutil.Process]:
    """SIGSTOP `proc` for the block; SIGCONT on the way out, exceptions included.

    psutil checks the process's create time before signalling, so a reused pid is never touched.
    """
    proc.suspend()
    try:
        yield proc
    finally:
        with suppress(psutil.NoSuchProcess):  # killed meanwhile (e.g. vLLM shut down): nothing to continue
            proc.resume()


def kill(proc: psutil.Process, timeout: float = 10.0) -> None:
    """SIGKILL `proc` and wait (bounded) until it is gone or a zombie. Safe if already dead."""
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        return
    try:
        proc.wait(timeout)  # reaps only our own children; for others returns once it is gone
    except psutil.TimeoutExpired:
        if proc.status() != psutil.STATUS_ZOMBIE:
            raise
