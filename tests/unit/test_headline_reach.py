"""The headline and its runbook reach every place an operator reads first: summary.md (first, then the runbook's
link), the manifest (headline, runbook, culprit_node), the stack-confirmed verdict's reason (its event and log line),
the evidence events, and the stall_detected / evidence_captured alerts; the other alerts name their own pages."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

from tests.facts import clause_of, says
from tests.unit.test_evidence_bundle import capture, context, incident, stuck_capture
from tests.unit.test_headline import HEAD, head_round, on_worker1
from tests.unit.test_respond import Harness, config
from watchdog.core.processes import Capture
from watchdog.core.types import Decision, State, Transition
from watchdog.evidence.bundle.coordinator import EvidenceCoordinator
from watchdog.evidence.bundle.investigate import Evidence, EvidenceDone, EvidenceJob
from watchdog.evidence.bundle.write import said_of, write_bundle
from watchdog.evidence.explain.findings import assess
from watchdog.nodes.remote import merge

BASE = "https://runbooks.example/watchdog"


def test_summary_opens_with_the_headline_then_its_runbook(tmp_path: Path) -> None:
    cap = stuck_capture()
    path = write_bundle(tmp_path, incident(1_760_000_000.0), cap, assess(cap, work_pending=True), context(),
                        runbook_base=BASE)
    lines = [line for line in (path / "summary.md").read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# Incident ")
    assert lines[1].startswith("**Worker_TP1") and says(clause_of(lines[1], "Worker_TP1"), "stopped"), lines[1]
    assert lines[2] == f"Runbook: {BASE}/frozen-stopped-rank.md", lines[2]
    assert "runbooks/frozen.md" not in (path / "summary.md").read_text()
    m = json.loads((path / "manifest.json").read_text())
    assert m["headline"] == lines[1].strip("*") and m["runbook"] == "frozen-stopped-rank"
    assert m["runbook_link"] == f"{BASE}/frozen-stopped-rank.md"
    assert (m["culprit"], m["culprit_node"]) == ("Worker_TP1", "local")  # the old key kept, its node beside it
    assert said_of(path) == (m["headline"], "frozen-stopped-rank")
    assert said_of(tmp_path / "no-such-bundle") == ("", "")


def test_the_culprit_s_node_on_a_two_node_freeze(tmp_path: Path) -> None:
    base = capture(head_round(), head_round(), procs=HEAD)
    cap = merge(base, [on_worker1([("WorkerProc.worker_busy_loop", "multiproc_executor.py", 1)], "T")])
    path = write_bundle(tmp_path, incident(1_760_000_000.0), cap, assess(cap, work_pending=True), context())
    m = json.loads((path / "manifest.json").read_text())
    assert (m["culprit"], m["culprit_node"]) == ("Worker_TP1", "worker1"), m["cross_rank"]
    assert says(clause_of(m["headline"], "Worker_TP1"), "node", "worker1", "stopped"), m["headline"]
    assert m["runbook_link"] == "runbooks/frozen-stopped-rank.md"  # no runbook_base: the project's own pages
    assert "on node worker1" in (path / "summary.md").read_text().split("- culprit:")[1].splitlines()[0]


class Runner:
    def __init__(self) -> None:
        self.done: list[EvidenceDone] = []

    def request(self, job: EvidenceJob) -> None:
        pass

    def poll(self) -> list[EvidenceDone]:
        done, self.done = self.done, []
        return done


def test_a_stack_confirmed_freeze_is_said_by_its_headline() -> None:
    runner = Runner()
    coord = EvidenceCoordinator(runner, 40.0)
    cap: Capture = stuck_capture()
    findings = assess(cap, work_pending=True)
    coord.on_transition(Transition(1.0, "0", State.WORKING, State.SUSPECT, "no progress for 5s"), 1.0)
    runner.done.append(EvidenceDone(EvidenceJob("0", "suspect", "x", False, 1.0), 1.0, Evidence(cap, findings, 2.0),
                                    None))
    [out] = coord.collect(4.0)
    assert out.observation is not None and out.observation.decision is Decision.STUCK
    assert out.observation.reason.startswith("Worker_TP1") and says(out.observation.reason, "stopped", "all_reduce")
    assert out.event["headline"] == out.observation.reason and out.event["runbook"] == "frozen-stopped-rank"
    assert out.event["reason"] == findings.reason  # the decision's own reason is kept beside it
    assert out.incident is not None and out.incident.details["runbook"] == "frozen-stopped-rank"
    # the freeze's bundle: the bundle's own words (its GPU evidence may say more) win over the stacks'
    job = EvidenceJob("0", "frozen", "x", True, 1.0, "inc-1")
    runner.done.append(EvidenceDone(job, 1.0, Evidence(cap, findings, 2.0), Path("/b"),
                                    said=("Worker_TP1 waits on its own GPU", "frozen-waiting-on-gpu")))
    [out] = coord.collect(5.0)
    assert out.event["event"] == "evidence_captured" and out.event["headline"] == "Worker_TP1 waits on its own GPU"
    assert out.event["runbook"] == "frozen-waiting-on-gpu"


def harness(tmp_path: Path) -> Harness:
    cfg = config()
    return Harness(tmp_path, dataclasses.replace(cfg, alerts=replace(cfg.alerts, runbook_base=BASE)))


HEADLINE = "Worker_TP1 is stopped (SIGSTOP or a debugger); Worker_TP0 waits for it in all_reduce; EngineCore waits"


def test_the_alerts_of_a_stack_confirmed_freeze_carry_its_headline_and_runbook(tmp_path: Path) -> None:
    h = harness(tmp_path)
    h.step(State.SUSPECT)
    h.r.evidence("0", "stuck", None, {"headline": HEADLINE, "runbook": "frozen-stopped-rank"}, final=False)
    h.step(State.FROZEN, reason=f"stacks confirm: {HEADLINE} (running=2 waiting=0)")
    [stall] = h.alerts
    assert stall.event == "stall_detected" and stall.summary == HEADLINE
    assert stall.runbook == f"{BASE}/frozen-stopped-rank.md"
    h.r.evidence("0", "stuck", "/b", {"headline": HEADLINE, "runbook": "frozen-stopped-rank"})
    assert h.alerts[-1].event == "evidence_captured" and h.alerts[-1].summary == HEADLINE
    assert h.alerts[-1].runbook == f"{BASE}/frozen-stopped-rank.md"


def test_a_freeze_the_metric_window_decided_is_not_said_by_older_stacks(tmp_path: Path) -> None:
    h = harness(tmp_path)
    h.r.evidence("0", "stuck", None, {"headline": HEADLINE, "runbook": "frozen-stopped-rank"}, final=False)
    h.step(State.FROZEN, reason="no progress for 40s (running=2 waiting=0); metrics only")
    [stall] = h.alerts
    assert stall.summary.startswith("no progress for 40s") and stall.runbook == f"{BASE}/frozen.md"


def test_down_names_the_page_of_what_went_down(tmp_path: Path) -> None:
    h = Harness(tmp_path, config(down_after=0.0))
    h.step(State.DOWN, reason="VLLM::Worker_TP1 (pid 12) exited on node worker1")
    assert h.alerts[0].event == "engine_down" and h.alerts[0].runbook == "runbooks/down-rank-lost.md"
    (tmp_path / "2").mkdir()
    h2 = Harness(tmp_path / "2", config(down_after=0.0))
    h2.step(State.DOWN, reason="the API server stopped answering: connection refused")
    assert h2.alerts[0].runbook == "runbooks/down-api-server.md"


def test_a_failed_restart_and_giving_up_name_their_pages(tmp_path: Path) -> None:
    h = Harness(tmp_path, config(budget=1))
    h.step(State.FROZEN)
    h.r.evidence("0", "stuck", "/b", {})
    assert h.alerts[-1].runbook == "runbooks/frozen.md"  # stacks with no headline: the plain page
    h.step(State.FROZEN)
    h.recovery.finish(False, h.clock.wall, "no token in 600s", stage="proving")
    h.step(State.FROZEN, advance=700)
    h.step(State.FROZEN, advance=700)
    pages = {a.event: a.runbook for a in h.alerts}
    assert pages["restart_failed"] == "runbooks/restart-failed.md", h.sent()
    assert pages["gave_up"] == "runbooks/gave-up.md", h.sent()


def test_show_prints_the_headline_first_and_for_an_older_bundle_its_decision(tmp_path: Path) -> None:
    from tests.unit.test_evidence_bundle import watchdog, write

    state = tmp_path / "state"
    path = write(state / "incidents")
    r = watchdog("show", path.name, "--state-dir", str(state))
    shown = [line for line in r.stdout.splitlines() if line.strip()]
    assert r.returncode == 0 and shown[1].startswith("**Worker_TP1") and shown[2].startswith("Runbook: "), shown[:3]
    m = json.loads((path / "manifest.json").read_text())
    old = {k: v for k, v in m.items() if k not in ("headline", "runbook", "runbook_link", "culprit_node")}
    (path / "manifest.json").write_text(json.dumps(old))
    r = watchdog("show", path.name, "--state-dir", str(state))
    assert r.returncode == 0 and r.stdout.startswith(f"**{m['decision_reason']}**"), r.stdout[:200]
    assert "Runbook: runbooks/frozen.md" in r.stdout.split("# Incident")[0]


def test_show_takes_a_bundle_directory_as_its_help_offers(tmp_path: Path) -> None:
    """`watchdog show DIR`: a bundle copied off the host (or written by `dump --out`) is shown from its directory,
    wherever it lies; a directory that holds no bundle is refused by name."""
    from tests.unit.test_evidence_bundle import watchdog, write

    elsewhere = write(tmp_path / "copied")  # not under the state directory
    empty_state = tmp_path / "state"
    r = watchdog("show", str(elsewhere), "--state-dir", str(empty_state))
    assert r.returncode == 0, r.stderr
    assert r.stdout == (elsewhere / "summary.md").read_text()
    (tmp_path / "nothing").mkdir()
    r = watchdog("show", str(tmp_path / "nothing"), "--state-dir", str(empty_state))
    assert r.returncode == 2 and "no incident" in r.stderr and str(tmp_path / "nothing") in r.stderr, r.stderr
