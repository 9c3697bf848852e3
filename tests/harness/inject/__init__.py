"""Fault injection loaded by the engine itself (sitecustomize.py on PYTHONPATH; the faults in watchdog_inject.py)."""

from __future__ import annotations

from pathlib import Path

INJECT_DIR = Path(__file__).resolve().parent
ENV = "WATCHDOG_TEST_INJECT"


def injected_env(flag: Path) -> dict[str, str | None]:
    """VllmServer env overrides that load the injection, switched by the content of ``flag`` (see watchdog_inject)."""
    return {"PYTHONPATH": str(INJECT_DIR), ENV: str(flag)}
