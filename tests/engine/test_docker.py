"""The real CPU vLLM (TP=2) in real Docker containers, watched by the real watchdog on the host.

One dockerd of the tests' own (tests/harness/docker_daemon.py), one container per network shape shared by the tests
that leave it serving (tests/harness/docker_engine.py). The order below is the order of the daemons: the shapes
with the userland proxy on first, then the daemon without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.harness.docker_daemon import LABEL, DockerDaemon
from tests.harness.docker_engine import VENV_INSIDE, DockerVllm, ensure_image
from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.server import free_port, wait_running
from tests.harness.shared_server import TITLES, problem
from tests.harness.watcher import WatchdogProcess, event_time, quick_config
from watchdog.act.shm_sweep import LocalShm, container_root
from watchdog.evidence.gpu.fr_trigger import trigger

pytestmark = pytest.mark.engine


class Daemons:
    """At most one dockerd at a time (both configurations want docker0 and the same data root)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.current: DockerDaemon | None = None
        self.image = ""

    def get(self, userland_proxy: bool = True) -> DockerDaemon:
        if self.current is not None and self.current.userland_proxy != userland_proxy:
            self.close()
        if self.current is None:
            self.current = DockerDaemon(userland_proxy=userland_proxy).start()
            self.image = ensure_image(self.current, self.work)
        return self.current

    def close(self) -> None:
        daemon, self.current = self.current, None
        if daemon is not None:
            daemon.stop()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    d = Daemons(tmp_path_factory.mktemp("docker"))
    try:
        yield d
    finally:
        d.close()


class Engines:
    """One container per shape, kept while the tests leave it serving; ended with its daemon's change or at the end."""

    def __init__(self, daemons: Daemons, python: Path, model: Path) -> None:
        self.daemons, self.python, self.model = daemons, python, model
        self.by_shape: dict[str, DockerVllm] = {}

    def get(self, shape: str, wait: bool = True) -> DockerVllm:
        for other in [s for s in self.by_shape if s != shape]:
            self.by_shape.pop(other).stop()  # one vLLM at a time (2 cores), and before its daemon may go
        daemon = self.daemons.get(userland_proxy=shape != "proxy-off")
        engine = self.by_shape.get(shape)
        if engine is not None and (engine.daemon is not daemon or (wait and problem(engine) is not None)):  # type: ignore
            engine.stop()
            engine = None
        if engine is None:
            engine = DockerVllm(daemon, self.daemons.image, self.python, self.model, shape=shape,
                                name=f"ew-vllm-{shape}-{free_port()}")
            self.by_shape[shape] = engine.start()
        if wait:
            engine.wait_ready(300)
        return engine

    def close(self) -> None:
        for engine in self.by_shape.values():
            engine.stop()
        self.by_shape.clear()


@pytest.fixture(scope="module")
def engines(daemons: Daemons, engine_python: Path, fast_model: Path) -> Iterator[Engines]:
    e = Engines(daemons, engine_python, fast_model)
    try:
        yield e
    finally:
        e.close()


def dump(url: str, out: Path, daemon: DockerDaemon, *extra: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "watchdog", "dump", "--url", url, "--out", str(out), "--json", *extra],
                       capture_output=True, text=True, timeout=180, check=False, start_new_session=True,
                       env=daemon.env())
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout)


def by_title(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in manifest["processes"] if p["title"]}


def every_rank_dumped(manifest: dict[str, Any], engine: DockerVllm) -> dict[str, dict[str, Any]]:
    """EngineCore and both workers in the dump, with the host pids the harness sees, each with a stack."""
    procs, ranks = by_title(manifest), engine.processes()
    for title in ("VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"):
        assert title in procs, sorted(procs)
        assert procs[title]["pid"] == ranks[title].pid, (title, procs[title]["pid"], ranks[title].pid)
        assert procs[title]["frames"], f"no stack for {title}"
    return procs


def boot_watched(engine: DockerVllm, state_dir: Path, extra: str = "") -> list[dict[str, Any]]:
    """The real `watchdog run`, started while the container boots, until it says `idle`: its transitions."""
    wd = WatchdogProcess(engine.url, state_dir, quick_config(5.0, 15.0, 10.0, extra)).start()
    try:
        idle = wd.wait_for_state("idle", 300)
    finally:
        wd.stop()
    seen = [e for e in wd.transitions() if event_time(e) <= event_time(idle)]
    assert [e for e in seen if e["to"] == "starting"], seen
    assert not [e for e in seen if e["to"] in ("frozen", "suspect")], seen
    return seen


def restart_config(containers: list[str], timeout: float, extra: str = "") -> str:
    return quick_config(5.0, 25.0, 10.0, f"""
[capture]
timeout = 30.0
[restart]
boot_timeout = 300.0
evidence_timeout = 90.0
down_after = 2.0
budget = 1
[[restart.steps]]
kind = "docker"
containers = {json.dumps(containers)}
timeout = {timeout}
{extra}""")


@pytest.mark.parametrize("what", ["no such container", "no daemon"])
def test_a_docker_step_that_cannot_act_is_a_clear_failure(
        what: str, daemons: Daemons, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing serves on the URL (down from the start); the step names a container the daemon does not have, or
    DOCKER_HOST names a socket no daemon answers on: the restart fails, saying which command and docker's own reason,
    restart_failed is written once, the incident is kept (budget spent: given up), and nothing recovers."""
    daemon = daemons.get()
    monkeypatch.setenv("DOCKER_HOST", daemon.host if what == "no such container" else
                       f"unix://{daemon.run_dir / 'nobody.sock'}")
    name = f"ew-no-such-container-{free_port()}"
    wd = WatchdogProcess(f"http://127.0.0.1:{free_port()}", tmp_path / "wd", restart_config([name], 30)).start()
    try:
        failed = wd.wait_event("restart_failed", 90)
        wd.wait_event("gave_up", 30)
        time.sleep(3)  # a few more passes: nothing more is said of that restart
    finally:
        wd.stop()
    steps = next(e for e in wd.events() if e["event"] == "restart_steps")
    assert steps["ok"] is False, steps
    said = {"no such container": f"No such container: {name}", "no daemon": "Cannot connect to the Docker daemon"}
    assert f"docker restart {name}: exit status 1: " in failed["error"] and said[what] in failed["error"], failed
    assert [e["event"] for e in wd.events()].count("restart_failed") == 1 and failed["attempt"] == 1, wd.events()
    assert not [e for e in wd.events() if e["event"] in ("recovered", "resolved")]
    kept = json.loads((tmp_path / "wd" / "recovery.json").read_text())["incident"]
    assert kept["id"] == failed["incident"] and kept["attempts"] == 1, kept  # open, observed until a human acts


def test_a_container_that_ignores_sigterm_is_killed_after_the_steps_time_and_said_so(
        daemons: Daemons, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container whose PID 1 is `sleep` (a namespace's init gets no signal it has no handler for: SIGTERM does
    nothing). The docker restart step (timeout 6 s: `docker restart --time 4`) makes docker SIGKILL it after 4 s;
    the step succeeds and its record in restart_steps says it was killed, from docker's own kill events."""
    daemon = daemons.get()
    monkeypatch.setenv("DOCKER_HOST", daemon.host)
    name = f"ew-stubborn-{free_port()}"
    daemon.cli("run", "--detach", "--name", name, "--label", LABEL, "--volume", "/usr:/usr:ro", daemons.image,
               "/usr/bin/sleep", "infinity")
    try:
        first = json.loads(daemon.cli("inspect", name).stdout)[0]["State"]["StartedAt"]
        wd = WatchdogProcess(f"http://127.0.0.1:{free_port()}", tmp_path / "wd", restart_config([name], 6)).start()
        try:
            steps = wd.wait_event("restart_steps", 90)
        finally:
            wd.stop()
        step = next(s for s in steps["steps"] if s["what"] == f"docker restart {name}")
        assert steps["ok"] is True and step["argv"] == f"docker restart --time 4 {name}", steps
        assert step["killed"] == "not stopped within 4s of SIGTERM: docker killed it (SIGKILL)", step
        assert 4.0 <= step["seconds"] < 6.0, step
        state = json.loads(daemon.cli("inspect", name).stdout)[0]["State"]
        assert state["Running"] and state["StartedAt"] != first, state
        print(f"docker restart of a container ignoring SIGTERM: {step['seconds']}s (--time 4)")
    finally:
        daemon.cli("rm", "--force", name, check=False)


def test_the_container_booting_is_seen_starting_then_idle(
        engines: Engines, tmp_path: Path) -> None:
    """--network host: the watchdog, started before the container, sees it start, then serve and idle."""
    engine = engines.get("host", wait=False)
    seen = boot_watched(engine, tmp_path / "wd")
    # while the port was still closed: the container's server seen on the host by its command line
    assert seen[0]["to"] == "starting" and "starting up" in seen[0]["reason"], seen[0]
    assert engine.wait_ready(60) >= 0
    assert set(TITLES) <= set(engine.processes()), engine.processes()


def test_host_network_dump_finds_every_rank_and_its_stack(engines: Engines, tmp_path: Path) -> None:
    engine = engines.get("host")
    code, m = dump(engine.url, tmp_path / "incidents", engine.daemon)
    assert code == 0, m
    procs = every_rank_dumped(m, engine)
    assert procs["VLLM::Worker_TP1"]["class"] == "idle_reader_wait", procs["VLLM::Worker_TP1"]
    assert m["culprit"] is None


def test_host_network_worker_stopped_under_load_is_frozen_with_its_culprit(
        engines: Engines, tmp_path: Path) -> None:
    engine = engines.get("host")
    wd = WatchdogProcess(engine.url, tmp_path / "wd", quick_config(5.0, 60.0, 10.0, "[capture]\ngap = 2.0\n")).start()
    try:
        wd.wait_for_state("idle", 60)
        with LoadGenerator(engine.url, engine.model_name, threads=4, duration=150, request_timeout=250):
            wait_running(engine.url, 1, 30)
            with frozen(engine.process("VLLM::Worker_TP1")):
                stopped = time.time()
                event = wd.wait_for_state("frozen", 90, after=stopped)
                captured = wd.wait_event("evidence_captured", 60)
            wd.wait_for_state("working", 60, after=event_time(event))
    finally:
        wd.stop()
    assert "stacks confirm" in event["reason"], event
    assert captured["culprit"] == "Worker_TP1", captured
    print(f"docker --network host: stopped -> frozen {event_time(event) - stopped:.1f}s")


def test_a_docker_restart_step_restarts_the_container_and_recovery_proves_it(
        engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stopped under load: frozen, then `docker restart --time N <container>` through the real CLI and
    daemon, and the watchdog's own real generation proves the container back."""
    engine = engines.get("host")
    monkeypatch.setenv("DOCKER_HOST", engine.daemon.host)
    first_init, first_start = engine.pid, engine.inspect()["State"]["StartedAt"]
    wd = WatchdogProcess(engine.url, tmp_path / "wd", restart_config([engine.name], 60)).start()
    try:
        wd.wait_for_state("idle", 60)
        with LoadGenerator(engine.url, engine.model_name, threads=4, duration=200, request_timeout=250):
            wait_running(engine.url, 1, 30)
            with frozen(engine.process("VLLM::Worker_TP1")):
                started = wd.wait_event("restart_started", 150)
            recovered = wd.wait_event("recovered", 300)
    finally:
        wd.stop()
    steps = next(e for e in wd.events() if e["event"] == "restart_steps")
    assert steps["ok"] is True, steps
    assert recovered["incident"] == started["incident"]
    assert engine.pid not in (0, first_init), "the container's init is a new process"
    assert engine.is_alive() and engine.inspect()["State"]["StartedAt"] != first_start
    engine.complete("back again", max_tokens=4)
    print(f"docker restart step: restart_started -> recovered {event_time(recovered) - event_time(started):.1f}s")


def test_published_port_dump_finds_every_rank_behind_docker_proxy(engines: Engines, tmp_path: Path) -> None:
    """-p 127.0.0.1:P:8000 with the userland proxy: the host's listener is docker-proxy, the ranks are elsewhere."""
    engine = engines.get("published", wait=False)
    boot_watched(engine, tmp_path / "wd")
    engine.wait_ready(60)
    listeners = {c.pid for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN
                 and c.laddr and c.laddr.port == engine.host_port}
    assert [psutil.Process(p).name() for p in listeners if p] == ["docker-proxy"], listeners
    code, m = dump(engine.url, tmp_path / "incidents", engine.daemon)
    assert code == 0, m
    every_rank_dumped(m, engine)


def test_published_port_evidence_is_read_inside_the_container(
        engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same container (-p, docker-proxy), the engine venv at /opt/vllm-venv inside (the host has no such path):
    the bundle's versions come from the venv inside (torch is nowhere else), its log tail from `docker logs`; the
    restart's /dev/shm check lists the container's own /dev/shm; the Flight Recorder's pipe, named in the container's
    environment, is written inside the container and its dump read back from there."""
    engine = engines.get("published")
    monkeypatch.setenv("DOCKER_HOST", engine.daemon.host)
    assert not VENV_INSIDE.exists()
    venv_names = {p.name for p in (engine.python.parent.parent / "lib").glob("python3*/site-packages/*.dist-info")}
    torch = next(n for n in venv_names if n.startswith("torch-")).removeprefix("torch-").removesuffix(".dist-info")
    cfg = tmp_path / "named.toml"
    cfg.write_text(f"[capture]\ndocker_container = {json.dumps(engine.name)}\n")
    code, m = dump(engine.url, tmp_path / "incidents", engine.daemon, "--config", str(cfg))
    assert code == 0, m
    assert m["versions"].get("torch") == torch and m["versions"].get("vllm"), m["versions"]
    assert m["log_source"] == "docker logs --tail", m["log_source"]
    tail = next((tmp_path / "incidents").rglob("log-tail.txt")).read_text()
    theirs = engine.log_tail(400)
    mine = [line for line in tail.splitlines() if "Application startup complete" in line or "vLLM" in line]
    assert mine and all(line in theirs for line in mine), tail[-2000:]

    # /dev/shm: vLLM's own segments (in use) and one made inside, found in the container's /dev/shm, not the host's
    made = f"psm_ewtest{engine.host_port}"
    engine.exec("/usr/bin/touch", f"/dev/shm/{made}")
    try:
        report = LocalShm(False, root=container_root(engine.name))()
    finally:
        engine.exec("/usr/bin/rm", "-f", f"/dev/shm/{made}")
    assert not report.error and (made, 0) in report.stale and report.in_use >= 1, report
    assert not Path("/dev/shm", made).exists()

    # the Flight Recorder: the pipe its environment names, made inside; a reader there answers with a dump
    worker = engine.process("VLLM::Worker_TP0")
    engine.exec("/usr/bin/mkfifo", "/tmp/fr_pipe_0.pipe")
    engine.exec("/bin/sh", "-c", "cat /tmp/fr_pipe_0.pipe > /tmp/fr_got && "
                "printf '{\"version\": \"2.10\", \"entries\": []}' > /tmp/fr_dump_0", detach=True)
    deadline, result = time.monotonic() + 15, None
    while time.monotonic() < deadline:  # until the detached reader has the pipe open
        result = trigger([worker.pid], settle=5.0)
        if result.ranks and "nobody reads" not in result.ranks[0].error:
            break
        time.sleep(0.3)
    assert result is not None and [r.rank for r in result.ranks] == [0], result
    assert result.ranks[0].error == "" and b'"entries"' in result.ranks[0].data, result
    assert engine.exec("/usr/bin/cat", "/tmp/fr_got") == "1\n"
    assert not Path("/tmp/fr_pipe_0.pipe").exists() and not Path("/tmp/fr_dump_0").exists()
    print(f"inside the container: versions {m['versions']}; log tail {len(tail.splitlines())} lines; /dev/shm "
          f"{len(report.stale)} stale, {report.in_use} in use; FR dump read back in {result.ranks[0].seconds}s")


def test_userland_proxy_off_serves_through_the_nat(
        engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--userland-proxy=false: iptables' DNAT carries the connection into the container. dockerd itself holds the
    host port (bound and listening, to reserve it; the NAT takes the traffic before it could reach that socket):
    the host's listener is neither docker-proxy nor any process of the engine. The watchdog, told the container
    (`[capture] docker_container`), sees it boot and idle."""
    engine = engines.get("proxy-off", wait=False)
    monkeypatch.setenv("DOCKER_HOST", engine.daemon.host)
    named = f"[capture]\ndocker_container = {json.dumps(engine.name)}\n"
    boot_watched(engine, tmp_path / "wd", named)
    engine.wait_ready(60)
    listeners = {c.pid for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN
                 and c.laddr and c.laddr.port == engine.host_port}
    assert [psutil.Process(p).name() for p in listeners if p] == ["dockerd"], listeners
    assert not listeners & {p.pid for p in engine.host_processes()}
    assert engine.complete("through the nat", max_tokens=4)["choices"]
    assert set(TITLES) <= set(engine.processes())
    # told the container, dump finds every rank in it with its stack: dockerd, holding the port, is not the engine
    cfg = tmp_path / "named.toml"
    cfg.write_text(named)
    code, m = dump(engine.url, tmp_path / "incidents", engine.daemon, "--config", str(cfg))
    assert code == 0, m
    every_rank_dumped(m, engine)
