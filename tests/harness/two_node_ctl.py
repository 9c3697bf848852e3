"""Start or stop one half of the two-node vLLM, as a restart step does on a real node (a unit's ExecStart/Stop).

    python two_node_ctl.py start|stop|pre-start head|worker RUN_DIR

Reads RUN_DIR/<role>.json (argv, env, log), started detached in a session of its own with its pid in
RUN_DIR/<role>.pid; stop ends that session (SIGTERM, then SIGKILL after 15 s); pre-start does nothing but say it
ran (a pre-start hook). Every call appends "<unix time> <verb> <role> <pid namespace>" to RUN_DIR/steps.log when it
begins, so a test can check the order of the steps across nodes. Run with the engine venv's or any python: it only
starts and signals processes. vLLM's own launcher must be run through `vllm_serve_main.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start(run: Path, role: str) -> int:
    spec = json.loads((run / f"{role}.json").read_text())
    env = {**os.environ, **spec["env"]}
    with open(spec["log"], "ab") as log:
        p = subprocess.Popen(spec["argv"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True, cwd=str(run))
    (run / f"{role}.pid").write_text(str(p.pid))
    return 0


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(run: Path, role: str) -> int:
    pidfile = run / f"{role}.pid"
    if not pidfile.exists():
        return 0
    pgid = int(pidfile.read_text())
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    pidfile.unlink(missing_ok=True)
    return 0


def note(run: Path, verb: str, role: str) -> None:
    with open(run / "steps.log", "a", encoding="utf-8") as f:
        f.write(f"{time.time():.3f} {verb} {role} {os.readlink('/proc/self/ns/pid')}\n")


if __name__ == "__main__":
    verb, who, run_dir = sys.argv[1:4]
    note(Path(run_dir), verb, who)
    sys.exit({"start": start, "stop": stop}.get(verb, lambda _run, _role: 0)(Path(run_dir), who))
