"""Faults for a real engine's processes: freeze (SIGSTOP, always undone) and kill (SIGKILL)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import psutil


@contextmanager
def frozen(proc: psutil.Process, settle_timeout: float = 5.0) -> Iterator[psutil.Process]:
    """SIGSTOP `proc` for the block; SIGCONT on the way out, exceptions included.

    The block starts once the kernel shows the process stopped (state T): SIGSTOP is delivered
    asynchronously, and a process busy on the other core may run on for a moment after the kill().
    psutil checks the process's create time before signalling, so a reused pid is never touched.
    """
    proc.suspend()
    try:
        _wait_stopped(proc, settle_timeout)
        yield proc
    finally:
        with suppress(psutil.NoSuchProcess):  # killed meanwhile (e.g. vLLM shut down): nothing to continue
            proc.resume()


def _wait_stopped(proc: psutil.Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while proc.status() != psutil.STATUS_STOPPED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {proc.pid} not stopped {timeout} s after SIGSTOP: {proc.status()}")
        time.sleep(0.01)


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
