"""Two nodes, the worker's half in a container on the worker's own Docker daemon (issue 19, point 4).

The head's half runs bare in the head's PID and mount namespaces, as in test_two_nodes.py. The worker node
(tests/harness/sshnode.py: its own network, PID and mount namespaces behind a real sshd) runs a dockerd of its own
inside those namespaces (tests/harness/docker_node.py), and its half of the engine (``--headless --node-rank 1``) in
a container there, ``--network host`` (the node's network namespace and its veth). The worker's agent.toml names the
container (its log: ``docker logs``; its processes: the container's) and allows one step: ``docker restart`` of it.

The real `watchdog run` on the head: Worker_TP1 in the worker's container stopped under load is frozen with the
culprit Worker_TP1 on node worker1, its stack taken on the node through the agent; the restart then stops the head's
half, restarts the worker's container through the agent and the node's dockerd (the rank still stopped), starts the
head's half, and the watchdog's own first generation proves the pair back. Then Worker_TP1 killed under load: the
same restart, through the same steps.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.harness.docker_node import DockerWorkerPair, docker_worker_pair
from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.two_node import CTL, HeadWatchdog
from tests.harness.watcher import event_time

pytestmark = pytest.mark.engine

STEP_TIMEOUT = 60.0


def ctl_argv(verb: str, role: str, run: Path) -> list[str]:
    return [sys.executable, str(CTL), verb, role, str(run)]


def docker_step(container: str, node: str = "") -> str:
    return (f'kind = "docker"\naction = "restart"\ncontainers = {json.dumps([container])}\ntimeout = {STEP_TIMEOUT}\n'
            + (f'node = "{node}"\n' if node else ""))


def agent_toml(root: Path, container: str) -> str:
    """The worker node's own config: its container (log and processes) and the one step the head may run there."""
    return (f'audit_log = "{root}/node/agent.log"\ndocker_container = "{container}"\n'
            f"[[steps]]\n{docker_step(container)}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, engine_python: Path,
         fast_model: Path) -> Iterator[DockerWorkerPair]:
    root = tmp_path_factory.mktemp("two-nodes-docker")
    container = f"ew-vllm-worker-{secrets.token_hex(3)}"
    t0 = time.monotonic()
    with docker_worker_pair(root, engine_python, fast_model, agent_toml(root, container), root, container) as p:
        print(f"node dockerd, image and the pair serving: {time.monotonic() - t0:.1f}s")
        yield p


def daemon_config(pair: DockerWorkerPair) -> str:
    """stop the head's half, `docker restart` the worker's container on node worker1 (through its agent), start
    the head's half. Probes only when asked (a probe behind a stopped rank would hang the pair)."""
    run, name = pair.run, pair.container.name
    command = '[[restart.steps]]\nkind = "command"\naction = "{v}"\nargv = {a}\ntimeout = 90.0\n'
    steps = (command.format(v="stop", a=json.dumps(ctl_argv("stop", "head", run)))
             + f"[[restart.steps]]\n{docker_step(name, 'worker1')}"
             + command.format(v="start", a=json.dumps(ctl_argv("start", "head", run))))
    return ("[scrape]\ninterval = 0.5\n[judge]\nsuspect_after = 5.0\nstall_window = 60.0\n"
            "[probe]\ninterval = 600.0\nretry = 2.0\ntimeout = 60.0\n"
            "[capture]\ngap = 1.0\ntimeout = 20.0\n[state]\ntrace_max_bytes = 0\n"
            "[restart]\ndown_after = 3.0\nboot_timeout = 300.0\nevidence_timeout = 90.0\nbudget = 1\n"
            f"{steps}" + pair.node.toml() + f'docker_container = "{name}"\n')


@pytest.fixture
def head_watchdog(pair: DockerWorkerPair, tmp_path: Path) -> Iterator[HeadWatchdog]:
    w = HeadWatchdog(pair.url, pair.head_nsenter(), tmp_path / "watchdog", daemon_config(pair)).start()
    yield w
    w.stop()
    pair.continue_all()
    print(f"--- watchdog log ({w.log_path}), last lines ---\n{w.log_tail(40)}")



def wait_for(what: str, probe: Callable[[], Any], timeout: float, w: HeadWatchdog) -> Any:
    return w.wait_for(what, probe, timeout)


def node_ok(w: HeadWatchdog) -> bool:
    return any(e["event"] == "node_state" and e["node"] == "worker1" and e["state"] == "ok" for e in w.events())


def healthy(w: HeadWatchdog) -> bool:
    engines = w.status().get("engines") or [{}]
    first = engines[0] if isinstance(engines, list) else {}
    return str(first.get("state", "")) in ("idle", "working") and node_ok(w)


def restarted_through_the_agent(pair: DockerWorkerPair, w: HeadWatchdog, since: float,
                                before: dict[str, Any]) -> dict[str, Any]:
    """The restart's steps as run (the worker's container restarted by the node's own dockerd through its agent),
    recovery proven by the watchdog's generation, the container a new start; the restart_steps event."""
    steps = w.wait_event("restart_steps", 240)
    recovered = w.wait_event("recovered", 300)
    done = [(s["what"], s["node"], s["ok"]) for s in steps["steps"] if s["what"] != "shm check"]
    name, ctl = pair.container.name, f"command {sys.executable}"
    assert done == [(ctl, "local", True), (f"docker restart {name}", "worker1", True), (ctl, "local", True)], steps
    after = pair.container.state()
    assert after.get("Running") and after.get("StartedAt") != before.get("StartedAt"), (before, after)
    audit = [json.loads(line) for line in (pair.root / "node" / "agent.log").read_text().splitlines()]
    ran = [" ".join(r["argv"]) for r in audit if r["event"] == "running"]
    assert re.fullmatch(rf"docker restart --time \d+ {name}", ran[-1]), ran
    pair.generate(30)
    print(f"restart steps {steps['seconds']}s; recovered (first generation) {event_time(recovered) - since:.1f}s "
          f"after the fault")
    return steps


def test_worker_rank_in_its_container_stopped_under_load_frozen_then_restarted_through_the_agent(
        pair: DockerWorkerPair, head_watchdog: HeadWatchdog) -> None:
    w = head_watchdog
    pair.wait_ready(120)
    wait_for("healthy with node worker1 seen", lambda: healthy(w), 120, w)
    before = pair.container.state()
    tp1 = pair.worker_processes()["VLLM::Worker_TP1"]
    # the rank is the container's: a pid namespace below the node's
    assert os.readlink(f"/proc/{tp1.pid}/ns/pid") != os.readlink(f"/proc/{pair.node.sshd_pid}/ns/pid")
    load = LoadGenerator(pair.url, pair.model_name, threads=2, max_tokens=(64, 64), request_timeout=20,
                         duration=None).start()
    try:
        time.sleep(3)
        with frozen(tp1):
            stopped = time.time()
            event = w.wait_for_state("frozen", 90, after=stopped)
            captured = w.wait_event("evidence_captured", 90)
            # held stopped until the restart has run: `docker restart` must take a container with a stopped rank
            steps = restarted_through_the_agent(pair, w, stopped, before)
    finally:
        load.stop()
    took = event_time(event) - stopped
    print(f"Worker_TP1 in the worker's container stopped -> frozen {took:.1f}s: {event['reason']}")
    assert "stacks confirm" in event["reason"], event
    assert captured["culprit"] == "Worker_TP1", captured
    assert "worker1" in json.dumps(captured), captured
    dumps = Path(captured["bundle"]) / "dumps"
    # its stack, taken on the node by the agent's py-spy (the container's files read through /proc/PID/root)
    remote = [d for d in dumps.iterdir() if "Worker_TP1 on node worker1" in d.name]
    assert remote, sorted(d.name for d in dumps.iterdir())
    assert all(any(t["frames"] for t in json.loads(d.read_text())) for d in remote), remote
    assert not psutil.pid_exists(tp1.pid) or tp1.pid not in {p.pid for p in pair.worker_processes().values()}
    names = [e["event"] for e in w.events()]
    assert names.count("restart_started") == 1, names
    assert steps["ok"] is True


def test_worker_rank_in_its_container_killed_under_load_restarted_through_the_agent(
        pair: DockerWorkerPair, head_watchdog: HeadWatchdog) -> None:
    w = head_watchdog
    pair.wait_ready(120)
    wait_for("healthy with node worker1 seen", lambda: healthy(w), 120, w)
    before = pair.container.state()
    load = LoadGenerator(pair.url, pair.model_name, threads=2, max_tokens=(64, 64), request_timeout=20,
                         duration=None).start()
    try:
        time.sleep(3)
        tp1 = pair.worker_processes()["VLLM::Worker_TP1"]
        killed = time.time()
        os.kill(tp1.pid, signal.SIGKILL)
        opened = w.wait_event("incident_opened", 60)
        print(f"SIGKILL Worker_TP1 in the worker's container -> incident {event_time(opened) - killed:.1f}s: "
              f"{opened['kind']}: {opened['reason']}")
        assert re.search(r"Worker_TP1.* on node worker1", opened["reason"]), opened
        restarted_through_the_agent(pair, w, killed, before)
    finally:
        load.stop()
