"""One head watching eight nodes (`tests/harness/cluster.py`): each node its own network, PID and mount namespaces
with a real sshd running the real agent, and on each, stand-in ranks (real Python processes titled
``VLLM::Worker_TP<n>``, parked in a ZMQ poll: py-spy reads real stacks). The head runs in a PID namespace of its own,
against the small fake engine page (work pending, no token moving), so what is judged is the nodes' evidence.

- One rank on one node stopped: the real daemon (`watchdog run`) calls the engine frozen; its bundle holds the
  stacks of every rank of every node and names the culprit and its node; the restart runs in order across the
  nodes, each node's steps through its own agent: stop on the head and every node at once, start every worker node
  at once, then the head; proven by a generation.
- The same with one node's stop failing: that node is named, every other node's stop ran to its end, and nothing
  starts anywhere (no node half-restarted while another never stopped).
- One node's link cut: `watchdog dump` still brings every other node's stacks; that node is said unreachable in
  the bundle, the others complete (the nodes are asked at once, so the dead one costs its own timeout only: that
  they are asked at once is held by tests/unit/test_nodes_at_once.py; the times are printed here, not asserted).

``EW_WIDE_RANKS`` (default 8) sets the ranks per node: 8 x 8 = 64 ranks hold on 2 cores (about 1.5 GB).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import EngineModel, fake_engine
from tests.harness.cluster import Cluster, Rank
from tests.harness.two_node import HeadWatchdog
from tests.harness.watcher import event_time

NODES = 8
RANKS = int(os.environ.get("EW_WIDE_RANKS", "8"))


STEP = Path(__file__).resolve().parents[1] / "harness" / "step_mark.py"


def step_argv(marks: Path, verb: str, *url: str) -> list[str]:
    return [sys.executable, str(STEP), str(marks), verb, *url]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("wide")
    marks = root / "marks"
    marks.mkdir()
    allowed = "".join(f'[[steps]]\nkind = "command"\naction = "{v}"\nargv = {json.dumps(step_argv(marks, v))}\n'
                      f"timeout = 30.0\n" for v in ("stop", "start"))  # what each node's agent lets the head run
    with Cluster(root, NODES, RANKS, allowed) as c:
        c.marks = marks  # type: ignore[attr-defined]
        yield c


def marks_of(cluster: Cluster) -> list[tuple[float, float, str, str]]:
    """(begin, end, verb, node) of every restart step run, by node name (the head's: "local")."""
    path: Path = cluster.marks  # type: ignore[attr-defined]
    names = {n.addr: n.name for n in cluster.nodes} | {"head": "local"}
    lines = path.joinpath("steps.log").read_text().split("\n") if path.joinpath("steps.log").exists() else []
    return sorted((float(b), float(e), v, names[w]) for b, e, v, w in (x.split() for x in lines if x))


def restart_config(cluster: Cluster, url: str) -> str:
    """Probe seldom; restart once, in order: the head and every node stopped at once, every worker node started
    at once, then the head (its start makes the fake engine's new incarnation)."""
    marks: Path = cluster.marks  # type: ignore[attr-defined]
    workers = json.dumps([n.name for n in cluster.nodes])
    return ("[scrape]\ninterval = 0.5\n[judge]\nsuspect_after = 2.0\nstall_window = 4.0\n"
            "[probe]\ninterval = 600.0\nretry = 2.0\ntimeout = 30.0\n[capture]\ngap = 1.0\n"
            "[state]\ntrace_max_bytes = 0\n[restart]\nboot_timeout = 60.0\nbudget = 1\n"
            f'[[restart.steps]]\nkind = "command"\naction = "stop"\nargv = {json.dumps(step_argv(marks, "stop"))}\n'
            f'timeout = 30.0\nnodes = ["local", {workers[1:]}\n'
            f'[[restart.steps]]\nkind = "command"\naction = "start"\nargv = {json.dumps(step_argv(marks, "start"))}\n'
            f"timeout = 30.0\nnodes = {workers}\n"
            f'[[restart.steps]]\nkind = "command"\naction = "start"\n'
            f"argv = {json.dumps(step_argv(marks, 'start', url))}\ntimeout = 30.0\n" + cluster.toml())


def manifest(root: Path) -> tuple[dict[str, Any], Path]:
    """The bundle under ``root``: its manifest and its folder."""
    found = sorted(root.rglob("manifest.json"))
    assert found, f"no bundle under {root}"
    return dict(json.loads(found[-1].read_text())), found[-1].parent


def every_rank_dumped(m: dict[str, Any], bundle: Path, cluster: Cluster, skip: str = "") -> None:
    """Every rank of every node (but ``skip``'s) is in the bundle with its stacks (two rounds), from its own node."""
    for node in cluster.nodes:
        got = m["nodes"][node.name]
        if node.name == skip:
            continue
        titles = sorted(p["title"] for p in got["processes"])
        want = sorted(r.title for r in cluster.ranks if r.node is node)
        assert titles == want, (node.name, titles)
        assert got["stacks"] == "all" and got["evidence"] == "complete" and got["reachable"], (node.name, got)
        assert got["dumps"] == {"ok": 2 * RANKS, "failed": 0}, (node.name, got["dumps"])  # two rounds each
    files = {f.name for f in (bundle / "dumps").iterdir()}
    for r in cluster.ranks:
        if r.node.name != skip:
            assert any(f"Worker_TP{r.rank} on node {r.node.name}" in f for f in files), (r.title, sorted(files)[:4])


@contextlib.contextmanager
def stalled_under_daemon(cluster: Cluster, culprit: Rank, state: Path) -> Iterator[tuple[HeadWatchdog, EngineModel]]:
    """The real daemon in the head's namespace, restart steps across every node (`restart_config`), every node seen
    with its ranks; then ``culprit`` stopped and the fake engine stalled (work pending, no token moving). On the way
    out: the rank continued, the engine idle, the daemon stopped."""
    with fake_engine(EngineModel(gen=10, prompt=10)) as (url, model):
        w = HeadWatchdog(url, cluster.head_nsenter(), state, restart_config(cluster, url)).start()
        try:
            w.wait_for("every node seen with its ranks", lambda: {
                e["node"] for e in w.events() if e["event"] == "node_state" and e["state"] == "ok"} == {
                n.name for n in cluster.nodes}, 60)
            culprit.stop()
            with model.lock:
                model.running = 3  # work pending, no token moves
            yield w, model
        finally:
            culprit.cont()
            with model.lock:
                model.running, model.gen = 0, model.gen + 1
            w.stop()


def test_one_rank_of_sixty_four_stopped_is_frozen_with_every_ranks_stacks_and_its_node(
        cluster: Cluster, tmp_path: Path) -> None:
    culprit = cluster.rank(NODES * RANKS - 3)  # on the last node
    with stalled_under_daemon(cluster, culprit, tmp_path / "state") as (w, model):
        stopped = time.time()
        frozen = w.wait_for_state("frozen", 90, after=stopped - 1)
        print(f"stop -> frozen: {event_time(frozen) - stopped:.1f}s: {frozen['reason']}")
        w.wait_for("the incident's bundle", lambda: list((tmp_path / "state").rglob("manifest.json")), 60)
        culprit.cont()  # as its node's restart would
        steps = w.wait_event("restart_steps", 120)
        recovered = w.wait_event("recovered", 120)
        assert model.restarts == 1
    m, bundle = manifest(tmp_path / "state")
    assert m["culprit"] == culprit.title.removeprefix("VLLM::") and m["culprit_node"] == culprit.node.name, (
        m["culprit"], m["culprit_node"], m["headline"])
    assert m["decision"] == "stuck" and m["capture_complete"], m["decision_reason"]
    assert m["headline"].startswith(f"{m['culprit']} on node {culprit.node.name} is stopped"), m["headline"]
    assert f"{NODES * RANKS - 1} processes on {NODES} nodes" in m["headline"], m["headline"]  # counted, not listed
    every_rank_dumped(m, bundle, cluster)
    print(f"{len(cluster.ranks)} ranks on {NODES} nodes; culprit {m['culprit']} on {m['culprit_node']}: "
          f"{m['headline']}")
    assert steps["ok"] and all(x["ok"] for x in steps["steps"]), steps
    ran = [(v, n) for _, _, v, n in marks_of(cluster)]
    names = [n.name for n in cluster.nodes]
    assert sorted(ran[:NODES + 1]) == sorted(("stop", n) for n in ["local", *names]), ran
    assert sorted(ran[NODES + 1:2 * NODES + 1]) == sorted(("start", n) for n in names) and ran[-1] == (
        "start", "local"), ran
    marks = marks_of(cluster)
    stops, starts, head = marks[:NODES + 1], marks[NODES + 1:-1], marks[-1]
    assert max(b for b, _, _, _ in stops) < min(e for _, e, _, _ in stops), stops  # all stops at once
    assert max(e for _, e, _, _ in stops) <= min(b for b, _, _, _ in starts), marks  # starts after every stop
    assert max(b for b, _, _, _ in starts) < min(e for _, e, _, _ in starts), starts  # the workers' at once
    assert max(e for _, e, _, _ in starts) <= head[0], marks  # the head last
    for n in cluster.nodes:  # each node's steps ran through its own agent
        runs = [json.loads(x) for x in n.audit_log.read_text().splitlines() if '"run"' in x]
        assert len(runs) >= 2, (n.name, runs[-3:])
    print(f"restart across {NODES} nodes: steps {steps['seconds']}s (three groups of {STEP.name}'s 2 s hold); "
          f"stop -> recovered {event_time(recovered) - stopped:.1f}s")


def test_a_stop_failing_on_one_node_is_said_by_name_and_nothing_starts_anywhere(cluster: Cluster,
                                                                               tmp_path: Path) -> None:
    marks: Path = cluster.marks  # type: ignore[attr-defined]
    failing = cluster.nodes[5]
    (marks / f"fail-{failing.addr}").touch()
    before = len(marks_of(cluster))
    culprit = cluster.rank(2)
    try:
        with stalled_under_daemon(cluster, culprit, tmp_path / "state") as (w, model):
            failed = w.wait_event("restart_failed", 150)
            steps = w.wait_event("restart_steps", 10)
            assert model.restarts == 0
    finally:
        (marks / f"fail-{failing.addr}").unlink()
    print(f"restart_failed: {failed['error']}")
    assert f"on node {failing.name}: {failing.name}: exit status 1" in failed["error"], failed
    assert failed["stage"] == "steps", failed
    assert [x["node"] for x in steps["steps"] if not x["ok"]] == [failing.name], steps
    ran = marks_of(cluster)[before:]
    assert sorted((v, n) for _, _, v, n in ran) == sorted(("stop", n) for n in ["local", *(x.name for x in
                                                                                           cluster.nodes)]), ran


def in_head(argv: list[str], timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``argv`` (nsenter into the head's namespaces first) in a session of its own, its whole group ended if it
    overruns (nsenter -p forks: a timeout of the nsenter alone would leave the command running)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=10)
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def test_a_dead_node_costs_its_own_time_and_is_said_while_every_other_node_is_dumped(
        cluster: Cluster, tmp_path: Path) -> None:
    dead = cluster.nodes[3]
    config = tmp_path / "watchdog.toml"
    config.write_text('[engine]\nurl = "http://127.0.0.1:9"\n[capture]\ngap = 1.0\n' + cluster.toml())
    argv = [*cluster.head_nsenter(), sys.executable, "-m", "watchdog", "dump", "--config", str(config), "--json"]
    t0 = time.monotonic()
    whole = in_head([*argv, "--out", str(tmp_path / "whole")])
    took_whole = time.monotonic() - t0
    dead.link(False)
    try:
        t0 = time.monotonic()
        cut = in_head([*argv, "--out", str(tmp_path / "cut")])
        took_cut = time.monotonic() - t0
    finally:
        dead.link(True)
    print(f"watchdog dump of {NODES} nodes x {RANKS} ranks: {took_whole:.1f}s; with {dead.name}'s link cut: "
          f"{took_cut:.1f}s (its connect_timeout: 3s)")
    m, bundle = manifest(tmp_path / "whole")
    every_rank_dumped(m, bundle, cluster)
    assert json.loads(whole.stdout)["complete"], whole.stderr[-2000:]
    m, bundle = manifest(tmp_path / "cut")
    every_rank_dumped(m, bundle, cluster, skip=dead.name)
    lost = m["nodes"][dead.name]
    assert not lost["reachable"] and lost["evidence"] == "missing" and not lost["processes"], lost
    said = [p for p in m["problems"] if dead.name in p]
    assert any("unreachable" in p and "no stacks" in p for p in said), m["problems"]
    assert not json.loads(cut.stdout)["complete"]  # a node's evidence is missing: the bundle says it is partial
    others = [p for p in m["problems"] if "node" in p and dead.name not in p and "metrics page" not in p]
    assert not others, others
