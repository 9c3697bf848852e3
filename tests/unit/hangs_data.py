"""Load a bundle the real `watchdog run` wrote (tests/data/hangs/<name>/: manifest.json, dumps/, ring.json) back
into the Capture it was made from: the processes, both rounds of real py-spy JSON with the /proc state, the rings.
The bundles come from the live scenarios of tests/engine/test_lost_wakeup_live.py and test_lost_wakeup_two_nodes.py
(tests/data/hangs/README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from watchdog.core.processes import Capture, Dump, EngineProcess, ProcFacts
from watchdog.core.roles import Role
from watchdog.nodes.protocol import ring_from_json

DATA = Path(__file__).resolve().parents[1] / "data" / "hangs"


def load(name: str, root: Path = DATA) -> tuple[Capture, dict[str, Any]]:
    """The capture of bundle ``name`` and its manifest."""
    d = root / name
    m: dict[str, Any] = json.loads((d / "manifest.json").read_text())
    procs, rounds = [], [{}, {}]  # type: ignore[var-annotated]
    for p in m["processes"]:
        # the stored bundles' format: another node's process has its pid there in "node_pid", and "pid" (a number
        # unique across nodes) names its dump files
        key, pid = p["pid"], p.get("node_pid", p["pid"])
        procs.append(EngineProcess(pid, Role(p["role"]), p["title"].split(" on node ")[0], dict(p["ranks"]),
                                   None, p["node"]))
        cpu = p.get("cpu_seconds_between_captures") or 0.0
        quiet = p.get("cpu_in_quiet_pauses")
        for n, rnd in enumerate(rounds, 1):
            facts = ProcFacts(p["state"], p.get("wchan") or "", cpu * (n - 1), p.get("threads") or 1)
            found = sorted(d.glob(f"dumps/round{n}-{key}-*.json"))
            text = found[0].read_text() if found else ""
            gap = float(quiet[1]) if quiet else 2.0  # the rounds as far apart as they were taken
            rnd[procs[-1].id] = Dump(pid, gap * (n - 1), bool(text.strip()), text,
                                     "" if text.strip() else "not read", False, facts,
                                     quiet=tuple(quiet) if quiet and n > 1 else None)
    ring = d / "ring.json"  # none where no ring was read (TP=1: EngineCore has no workers)
    rings = tuple(ring_from_json(r, r.get("node", "local")) for r in json.loads(ring.read_text())) \
        if ring.exists() else ()
    return Capture(tuple(procs), tuple(rounds), rings=rings), m
