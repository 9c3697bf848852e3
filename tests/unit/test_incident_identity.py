"""One incident, one id: the bundle's directory, every event, every alert, `watchdog status` and `watchdog show`.

The real daemon process against the small fake engine, with stack capture on (py-spy reads the fake's listener,
this test process: there is no engine rank, so the stacks cannot decide, and the freeze's bundle is still written).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.fakes import EngineModel, fake_engine, wait_for
from tests.receiver import Receiver
from tests.unit.test_act_daemon import Daemon, config, freeze


def test_one_id_joins_bundle_events_alerts_status_and_show(
        tmp_path: Path, receiver: Callable[..., Receiver], daemon_proc: list[subprocess.Popen[str]]) -> None:
    hook = receiver()
    capture = "[capture]\nenabled = true\ngap = 0.5\ntimeout = 20\n"
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        cfg = config(tmp_path, url, [hook.url + "/hook"], delay=3.0, extra="")
        cfg.write_text(cfg.read_text().replace("[capture]\nenabled = false\n", capture))
        d = Daemon(cfg, tmp_path / "state", daemon_proc)
        d.start("--url", url)
        wait_for(lambda: any(e.get("to") == "idle" for e in d.events("transition")), 30, "idle")
        freeze(model)
        opened = d.wait_event("incident_opened")
        captured = d.wait_event("evidence_captured", timeout=60)
        started = d.wait_event("restart_started", timeout=60)
        status = json.loads(d.cli("status", "--json").stdout)
        resolved = d.wait_event("resolved", timeout=60)
        wait_for(lambda: len(hook.received) >= 5, 15, "five alerts")
        show = d.cli("show", opened["incident"])
        d.stop()
    iid = opened["incident"]
    assert iid.endswith(tuple("0123456789abcdef")) and "-engine0-frozen-" in iid
    assert captured["incident"] == started["incident"] == resolved["incident"] == iid
    bundle = Path(captured["bundle"])
    assert bundle.name == iid and bundle.parent == tmp_path / "state" / "incidents"
    assert json.loads((bundle / "manifest.json").read_text())["id"] == iid
    assert status["incident"] is None or status["incident"]["id"] == iid  # open while restarting, or resolved
    assert {b["incident_id"] for b in hook.bodies()} == {iid}
    assert show.returncode == 0 and f"# Incident {iid}" in show.stdout
