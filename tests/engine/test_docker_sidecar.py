"""The watchdog's own image (deploy/image/build.py) as a sidecar of the real CPU vLLM TP=2 in the tests' Docker.

One dockerd of the tests' own, one engine container (published port, docker-proxy), the image built by the builder
as a user runs it (the shared cached Debian 13 root, the wheel built from this checkout), imported into that daemon
and cached in its data root. Each sidecar is a real `docker run` of the image with its default command (`watchdog
run`), CAP_SYS_PTRACE, the config mounted at /etc/engine-watchdog/config.toml and the state directory bind-mounted
from the test's tmp, where the events and bundles are read:

- in the engine's PID and network namespaces (`--pid container:NAME --network container:NAME`, a pod's shape): it
  sees only the container's processes, numbered as the container numbers them;
- in the host's PID and network namespaces with the tests' Docker socket mounted: its docker restart step restarts
  the engine container. (A sidecar inside the engine's PID namespace dies with the engine's PID 1, so it cannot
  prove its own restart: docs/image.md.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.harness.debian_root import missing_tools, tarball
from tests.harness.docker_daemon import LABEL, DockerDaemon
from tests.harness.docker_engine import CONTAINER_PORT, DockerVllm, ensure_image
from tests.harness.faults import frozen
from tests.harness.load import LoadGenerator
from tests.harness.server import free_port, wait_running
from tests.harness.shared_server import problem
from tests.harness.watcher import WatchdogProcess, event_time, quick_config

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
BUILDER = ROOT / "deploy" / "image" / "build.py"
RANKS = ("VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1")


def build_wheel(out: Path) -> Path:
    """The project's wheel, as the builder makes it: it records the checkout's commit, so it is built once per test
    run and given to every build (a commit made meanwhile would be a new input)."""
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   capture_output=True, timeout=600, check=True, stdin=subprocess.DEVNULL)
    [wheel] = out.glob("engine_watchdog-*.whl")
    return wheel


def build_image(daemon: DockerDaemon, wheel: Path) -> tuple[str, float]:
    """The builder as a user runs it, against the tests' daemon: (its last line, seconds)."""
    began = time.monotonic()
    r = subprocess.run([sys.executable, str(BUILDER), "--root-tar", str(tarball("trixie")), "--wheel", str(wheel)],
                       capture_output=True, text=True, timeout=1200, check=False, start_new_session=True,
                       env=daemon.env(), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1], time.monotonic() - began


@dataclass
class Setup:
    daemon: DockerDaemon
    image: str
    engine: DockerVllm
    wheel: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, engine_python: Path, fast_model: Path) -> Iterator[Setup]:
    if missing := missing_tools():
        pytest.skip(f"the image's Debian root needs: {', '.join(missing)}")
    daemon = DockerDaemon().start()
    engine: DockerVllm | None = None
    try:
        work = tmp_path_factory.mktemp("docker")
        base = ensure_image(daemon, work)
        engine = DockerVllm(daemon, base, engine_python, fast_model, shape="published",
                            name=f"ew-vllm-sidecar-{free_port()}").start()  # it boots while the image builds
        wheel = build_wheel(work / "dist")
        said, seconds = build_image(daemon, wheel)
        print(f"image: {said} ({seconds:.1f} s)")
        engine.wait_ready(300)
        yield Setup(daemon, said.split()[0], engine, wheel)
    finally:
        if engine is not None:
            engine.stop()
        daemon.stop()


def serving(s: Setup) -> DockerVllm:
    """The engine container, serving and quiet; restarted first if a test before left it otherwise."""
    why = problem(s.engine)  # type: ignore[arg-type]  # the same checks as the shared server's
    if why is not None:
        s.engine.continue_all()
        s.daemon.cli("restart", "--time", "10", s.engine.name, timeout=120)
        s.engine.started_at = time.monotonic()
        s.engine.wait_ready(300)
    return s.engine


class Sidecar(WatchdogProcess):
    """`docker run` of the image in the foreground (its exit is the container's); events from the mounted state."""

    def __init__(self, s: Setup, state_dir: Path, config_text: str, namespaces: list[str]) -> None:
        super().__init__("", state_dir, config_text)
        self.daemon, self.image, self.namespaces = s.daemon, s.image, namespaces
        self.name = f"ew-sidecar-{free_port()}"

    def start(self) -> Sidecar:
        argv = ["docker", "-H", self.daemon.host, "run", "--name", self.name, "--label", LABEL,
                "--cap-add", "SYS_PTRACE", *self.namespaces,
                "--volume", f"{self.state_dir}:/var/lib/engine-watchdog",
                "--volume", f"{self.config}:/etc/engine-watchdog/config.toml:ro", self.image]
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        self.started_at = time.time()
        return self

    def stop(self) -> int | None:
        self.daemon.cli("stop", "--time", "15", self.name, timeout=60, check=False)
        code = super().stop()  # the foreground CLI ends with its container (SIGTERM to it only if it lingers)
        self.daemon.cli("rm", "--force", self.name, timeout=60, check=False)
        return code

    def bundle(self, captured: dict[str, Any]) -> dict[str, Any]:
        """The manifest of an evidence_captured event's bundle, read from the mounted state directory."""
        inside = Path(captured["bundle"])
        m: dict[str, Any] = json.loads((self.state_dir / inside.relative_to("/var/lib/engine-watchdog")
                                        / "manifest.json").read_text())
        return m


def sidecar_config(url: str, extra: str = "") -> str:
    return quick_config(5.0, 60.0, 10.0, f'[engine]\nurl = "{url}"\n[exporter]\nport = 0\n{extra}')


def ns_pid(proc: psutil.Process) -> int:
    """`proc`'s pid in its innermost PID namespace (the container's numbering)."""
    with open(f"/proc/{proc.pid}/status") as f:
        return int(next(line for line in f if line.startswith("NSpid:")).split()[-1])


def freeze_under_load(engine: DockerVllm, wd: Sidecar, until: str) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Load, then Worker_TP1 stopped from the host (always continued) until the watchdog says `until`: the frozen
    transition, the evidence_captured event, and the wall time of the stop."""
    with LoadGenerator(engine.url, engine.model_name, threads=4, duration=200, request_timeout=250):
        wait_running(engine.url, 1, 30)
        with frozen(engine.process("VLLM::Worker_TP1")):
            stopped = time.time()
            event = wd.wait_for_state("frozen", 90, after=stopped)
            captured = wd.wait_event("evidence_captured", 60)
            if until != "evidence_captured":
                wd.wait_event(until, 150)
        if until == "evidence_captured":
            wd.wait_for_state("working", 90, after=event_time(event))
    return event, captured, stopped


def stopped_rank_named(event: dict[str, Any], captured: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    """frozen by the stacks, culprit Worker_TP1 in the event and the bundle, every rank with a stack; by title."""
    assert "stacks confirm" in event["reason"], event
    assert captured["culprit"] == "Worker_TP1" and captured["complete"], captured
    assert m["culprit"] == "Worker_TP1" and m["headline"].startswith("Worker_TP1") and m["capture_complete"], m
    procs = {p["title"]: p for p in m["processes"] if p["title"]}
    for title in RANKS:
        assert title in procs and procs[title]["frames"], (title, sorted(procs))
    return procs


def test_the_image_is_built_once_and_runs_the_watchdog(setup: Setup) -> None:
    """The builder's second run with the same inputs builds nothing, and no image it replaced is left; the image's
    entrypoint is the venv's watchdog (its version and commit), with py-spy, a docker CLI and pkill, no systemd."""
    said, seconds = build_image(setup.daemon, setup.wheel)
    assert "is up to date" in said and "nothing built" in said, said
    inspect = json.loads(setup.daemon.cli("image", "inspect", setup.image).stdout)[0]
    config = inspect["Config"]
    assert config["Entrypoint"] == ["/opt/engine-watchdog/.venv/bin/watchdog"] and config["Cmd"] == ["run"], config
    assert config["Labels"]["io.engine-watchdog.inputs"][:16] in said, config["Labels"]
    replaced = setup.daemon.cli("images", "--quiet", "--filter", "dangling=true", "--filter",
                                "label=io.engine-watchdog.inputs").stdout.split()
    assert not replaced, replaced  # a build removes the image it untagged
    version = setup.image.rpartition(":")[2]

    def inside(*argv: str, entrypoint: str = "") -> str:
        r = setup.daemon.cli("run", "--rm", "--label", LABEL, *(["--entrypoint", entrypoint] if entrypoint else []),
                             setup.image, *argv, timeout=120, check=False)
        return (r.stdout + r.stderr).strip() if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()}"

    assert inside("--version").startswith(f"engine-watchdog {version} (commit "), inside("--version")
    assert inside("--version", entrypoint="py-spy").startswith("py-spy 0."), inside("--version", entrypoint="py-spy")
    assert inside("--version", entrypoint="docker").startswith("Docker version ")
    assert "procps-ng" in inside("--version", entrypoint="pkill")
    assert inside("-W", "systemd", entrypoint="dpkg-query").startswith("exit 1")  # purged from the host root
    print(f"cached build: {seconds:.1f} s; {inspect['Size'] / 1e6:.0f} MB")


def test_a_sidecar_in_the_engines_pid_namespace_finds_the_stopped_worker(setup: Setup, tmp_path: Path) -> None:
    """--pid and --network of the engine's container (a pod's sidecar): `watchdog run` from the image, on
    127.0.0.1:8000 inside, sees Worker_TP1 stopped under load frozen, the stacks confirming, the culprit in its
    bundle with every rank's stacks, numbered as the container numbers them; then working again once continued."""
    engine = serving(setup)
    ns = ["--pid", f"container:{engine.name}", "--network", f"container:{engine.name}"]
    wd = Sidecar(setup, tmp_path / "state", sidecar_config(f"http://127.0.0.1:{CONTAINER_PORT}",
                                                           "[capture]\ngap = 2.0\n"), ns).start()
    try:
        wd.wait_for_state("idle", 90)
        event, captured, stopped = freeze_under_load(engine, wd, "evidence_captured")
    finally:
        wd.stop()
    procs = stopped_rank_named(event, captured, wd.bundle(captured))
    ranks = engine.processes()
    for title in RANKS:  # the container's own pids, not the host's
        assert procs[title]["pid"] == ns_pid(ranks[title]) != ranks[title].pid, (title, procs[title]["pid"])
    print(f"sidecar in the engine's PID namespace: stopped -> frozen {event_time(event) - stopped:.1f}s")


def test_a_sidecar_with_the_docker_socket_restarts_the_engine_container(setup: Setup, tmp_path: Path) -> None:
    """The host's PID and network namespaces and the tests' Docker socket at /var/run/docker.sock: the frozen
    engine's bundle names Worker_TP1, the image's docker CLI runs `docker restart --time N NAME` through the socket,
    and the watchdog's own generation proves the new container serving."""
    engine = serving(setup)
    first_init, first_start, ranks = engine.pid, engine.inspect()["State"]["StartedAt"], engine.processes()
    ns = ["--pid", "host", "--network", "host", "--volume", f"{setup.daemon.socket}:/var/run/docker.sock"]
    extra = f"""[capture]
gap = 2.0
docker_container = "{engine.name}"
[restart]
boot_timeout = 300.0
evidence_timeout = 90.0
down_after = 2.0
budget = 1
[[restart.steps]]
kind = "docker"
containers = ["{engine.name}"]
timeout = 60
"""
    wd = Sidecar(setup, tmp_path / "state", sidecar_config(engine.url, extra), ns).start()
    try:
        wd.wait_for_state("idle", 90)
        event, captured, _ = freeze_under_load(engine, wd, "restart_started")
        recovered = wd.wait_event("recovered", 300)
    finally:
        wd.stop()
    m = wd.bundle(captured)
    procs = stopped_rank_named(event, captured, m)
    for title in RANKS:  # the host's pids: the sidecar is in the host's PID namespace
        assert procs[title]["pid"] == ranks[title].pid, (title, procs[title]["pid"], ranks[title].pid)
    steps = next(e for e in wd.events() if e["event"] == "restart_steps")
    step = next(s for s in steps["steps"] if s["what"] == f"docker restart {engine.name}")
    assert steps["ok"] is True and step["argv"] == f"docker restart --time 54 {engine.name}", steps
    started = next(e for e in wd.events() if e["event"] == "restart_started")
    assert recovered["incident"] == started["incident"] == m["id"], (recovered, started, m["id"])
    assert engine.pid not in (0, first_init) and engine.inspect()["State"]["StartedAt"] != first_start
    assert engine.complete("after the sidecar's restart", max_tokens=4)["choices"]
    print(f"sidecar's docker restart: restart_started -> recovered {event_time(recovered) - event_time(started):.1f}s")
