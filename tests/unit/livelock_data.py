"""Load tests/data/livelock/<fault>/ (real py-spy dumps and /proc facts of the CPU vLLM; its README) as a Capture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from watchdog.core.processes import LOCAL, Capture, Dump, EngineProcess, ProcessId, ProcFacts
from watchdog.core.roles import Role
from watchdog.evidence.explain.findings import PageWork

DATA = Path(__file__).resolve().parents[1] / "data" / "livelock"


def load(fault: str, root: Path = DATA) -> tuple[Capture, PageWork | None, dict[str, Any]]:
    """The capture as the daemon took it, the page's running/waiting then, and the findings when recorded."""
    d = root / fault
    raw = json.loads((d / "capture.json").read_text())
    procs = tuple(EngineProcess(p["pid"], Role(p["role"]), p["title"], dict(p["ranks"]), p["ppid"])
                  for p in raw["processes"])
    rounds = []
    for rnd in raw["rounds"]:
        dumps = {}
        for pid, f in rnd.items():
            facts = ProcFacts(f["state"], f["wchan"], f["cpu_seconds"], f["threads"]) if f["state"] else None
            output = (d / f["file"]).read_text() if f["ok"] else ""
            dumps[ProcessId(LOCAL, int(pid))] = Dump(int(pid), f["t"], f["ok"], output, "" if f["ok"] else "not read",
                                   f["nonblocking"], facts)
        rounds.append(dumps)
    page = PageWork(raw["page"]["running"], raw["page"]["waiting"]) if raw["page"] else None
    return Capture(procs, tuple(rounds)), page, raw["findings_when_recorded"]
