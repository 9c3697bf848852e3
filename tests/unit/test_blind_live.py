"""A node that cannot be seen, with real parts: the real service (`watchdog run`), a second node in network, PID and
mount namespaces of the test's own behind a real sshd running the real agent, and a real webhook receiver
(tests/harness/alert_sink_main.py). The engine's page comes from the small fake server (the node's agent needs no
engine to be seen or lost). The link to the node is cut: the receiver gets the blind alert naming the node and why;
the engine then stalls here: the same incident says "frozen here while node worker1 cannot be seen"; the link back:
the blind incident is resolved, and the freeze goes the usual way (its own incident)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.facts import line_of, says
from tests.fakes import EngineModel, fake_engine
from tests.harness.server import free_port
from tests.harness.sshnode import SshNode
from tests.harness.watcher import WatchdogProcess

SINK = Path(__file__).resolve().parents[1] / "harness" / "alert_sink_main.py"
BLIND_AFTER = 3.0
LIVENESS_STALE = 6.0  # the [[nodes]] default


class Receiver:
    """alert_sink_main.py in a session of its own, ended by its own id."""

    def __init__(self, root: Path) -> None:
        self.port, self.out = free_port(), root / "received.jsonl"
        self.log = root / "sink.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(SINK), "--port", str(self.port), "--out", str(self.out)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 20
        while "listening" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the alert sink did not start: {self.log.read_text(errors='replace')}")
            time.sleep(0.05)

    def alerts(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        return [json.loads(base64.b64decode(json.loads(line)["body_b64"]))
                for line in self.out.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SshNode]:
    with SshNode(tmp_path, f'audit_log = "{tmp_path}/node/agent.log"\n') as n:
        yield n


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path)
    yield r
    r.close()


def wait(what: str, probe: Callable[[], Any], timeout: float, w: WatchdogProcess, r: Receiver) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := probe():
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f}s; alerts {[a['event'] for a in r.alerts()]}; events "
                         f"{[e['event'] for e in w.events()]}\n{w.log_tail(40)}")


def sent(r: Receiver, event: str, incident: str = "") -> dict[str, Any] | None:
    return next((a for a in r.alerts() if a["event"] == event and (not incident or a["incident_id"] == incident)),
                None)


def test_a_node_cut_off_is_alerted_by_name_said_with_a_freeze_here_and_resolved_when_seen(
        tmp_path: Path, node: SshNode, receiver: Receiver) -> None:
    config = ("[scrape]\ninterval = 0.2\n[judge]\nsuspect_after = 1.0\nstall_window = 2.0\n"
              "[probe]\ninterval = 1.0\nretry = 0.5\ntimeout = 3.0\n[capture]\nenabled = false\n"
              f"[state]\ntrace_max_bytes = 0\n[alerts]\nblind_after = {BLIND_AFTER}\n"
              f'[[alerts.sinks]]\nkind = "webhook"\nurl = "http://127.0.0.1:{receiver.port}/hook"\n' + node.toml())
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        w = WatchdogProcess(url, tmp_path / "state", config).start()
        try:
            wait("node worker1 seen", lambda: any(e["event"] == "node_state" and e["state"] == "no_ranks"
                                                  for e in w.events()), 30, w, receiver)
            cut = time.monotonic()
            node.link(False)
            try:
                blind = wait("the blind alert", lambda: sent(receiver, "blind"), LIVENESS_STALE + BLIND_AFTER + 20,
                             w, receiver)
                took = time.monotonic() - cut
                print(f"link cut -> blind alert: {took:.1f}s (liveness_stale {LIVENESS_STALE:g}s + blind_after "
                      f"{BLIND_AFTER:g}s): {blind['summary']}")
                assert blind["details"]["node"] == "worker1" and blind["details"]["kind"] == "blind"
                assert says(blind["summary"], "node worker1", "cannot be seen", "engine 0 is idle")
                assert blind["details"]["why"] and blind["details"]["why"] in blind["summary"]  # the view's reason
                assert blind["runbook"] == "runbooks/blind-node.md" and not blind["resolved"]
                assert blind["state"] == "blind" and "-blind-" in blind["incident_id"]
                iid = blind["incident_id"]
                status = json.loads((w.state_dir / "status.json").read_text())
                assert [(b["what"], b["incident"]) for b in status["blind"]] == [("node:worker1", iid)]
                shown = subprocess.run([sys.executable, "-m", "watchdog", "status", "--state-dir", str(w.state_dir)],
                                       capture_output=True, text=True, timeout=60, check=False).stdout
                assert says(line_of(shown, "blind:"), "node worker1", "not seen for", iid), shown
                with model.lock:
                    model.running = 3  # work pending here, nothing moves: frozen here while the node is unseen
                frozen = wait("frozen here said", lambda: sent(receiver, "blind_frozen", iid), 30, w, receiver)
                print(f"then: {frozen['summary']}")
                assert says(frozen["summary"], "engine 0", "frozen", "node worker1", "power-cycle", "watchdog reset")
                assert frozen["runbook"] == "runbooks/blind-node.md"
                assert not sent(receiver, "stall_detected")  # a freeze not seen whole is the blind incident's
            finally:
                node.link(True)
            back = time.monotonic()
            done = wait("the blind incident resolved", lambda: sent(receiver, "resolved", iid), 40, w, receiver)
            print(f"link back -> resolved: {time.monotonic() - back:.1f}s: {done['summary']}")
            assert done["resolved"] and says(done["summary"], "node worker1", "seen again")
            usual = wait("the freeze's own incident", lambda: sent(receiver, "stall_detected"), 20, w, receiver)
            assert usual["incident_id"] != iid
            names = [a["event"] for a in receiver.alerts()]
            assert names.index("resolved") < names.index("stall_detected"), names
            assert [a["event"] for a in receiver.alerts() if a["incident_id"] == iid] == [
                "blind", "blind_frozen", "resolved"]
        finally:
            with model.lock:
                model.running, model.gen = 0, model.gen + 1
            assert w.stop() == 0, w.log_tail(40)
