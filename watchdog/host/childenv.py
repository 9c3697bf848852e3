"""The environment for every process the watchdog starts: its own, minus what systemd meant for it alone.

``NOTIFY_SOCKET`` in a child would let it speak for the watchdog (with ``NotifyAccess=all``, or once it is the
main pid after an exec), and ``WATCHDOG_USEC``/``WATCHDOG_PID`` would make a child that uses sd_notify ping our
watchdog. py-spy, the context commands (journalctl, docker, nvidia-smi) and the restart commands get this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OURS_ALONE = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def child_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in OURS_ALONE}
