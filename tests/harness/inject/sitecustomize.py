"""Loaded by every Python process that has this directory on PYTHONPATH (vLLM's API server, EngineCore, workers).

Inert unless WATCHDOG_TEST_INJECT is set: then it installs the fault injection of `watchdog_inject` (see there).
Only engine tests set it, on the vLLM they start themselves (tests/harness/inject/__init__.py, restart_vllm.py).
"""

import os

if os.environ.get("WATCHDOG_TEST_INJECT"):
    import watchdog_inject

    watchdog_inject.install()
