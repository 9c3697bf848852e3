"""Programs for tests/engine/test_unit_sandbox.py, run as units of a throwaway systemd (from a copy in its /run,
which every user there may read).

    sandbox_probe.py probe OUT.json PYSPY CHECKOUT [SITE]
                      under the shipped unit's sandbox, does what the watchdog does, one check each (py-spy on
                      every kind of engine, a signal to another user's, systemctl, the Docker CLI, ssh, the
                      /dev/shm sweep, the Flight Recorder pipe, the journal, NVML when there is a GPU) and writes
                      {check: {"ok", "detail"}}; CHECKOUT (and SITE) go on sys.path for the watchdog's own code
    sandbox_probe.py engine [--shm] [--fifo PATH]
                      a Python "engine" parked in engine_marker_loop; --shm leaves a stale segment
                      /dev/shm/psm_probe (its own user's), --fifo makes a pipe and reads it (the Flight Recorder's)
    sandbox_probe.py container
                      PID 1 of a new mount and PID namespace: shows /usr at /run/ctr/usr there only and runs the
                      engine from that path (a container's files, invisible from the host's mount namespace)
    sandbox_probe.py dockerd SOCKET
                      a fake Docker Engine API on a Unix socket: every request answered, logged to SOCKET.log
"""

from __future__ import annotations

import http.server
import json
import os
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENGINES = ("engine-root.service", "engine-user.service", "engine-container.service")
SHM_SEGMENT = "/dev/shm/psm_probe"
CONTAINER_USR = "/run/ctr/usr"


def run(argv: list[str], timeout: float = 60.0) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, start_new_session=True)
    if r.returncode != 0:
        raise RuntimeError(f"{argv[0]} exit {r.returncode}: {(r.stdout + r.stderr).strip()[-400:]}")
    return r.stdout


def main_pid(unit: str) -> int:
    return int(run(["systemctl", "show", "-p", "MainPID", "--value", unit]).strip())


def engine_pid(unit: str, wait: float = 30.0) -> int:
    """The engine's python: the unit's main process, or for the container the child of its unshare (once that
    runs the engine from the container's own /usr)."""
    pid = main_pid(unit)
    if unit != "engine-container.service":
        return pid
    deadline = time.monotonic() + wait
    while True:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids and os.readlink(f"/proc/{kids[0]}/exe").startswith(CONTAINER_USR):
            return int(kids[0])
        if time.monotonic() > deadline:
            raise AssertionError(f"{unit}: no engine under {CONTAINER_USR} after {wait:.0f}s (children {kids})")
        time.sleep(0.1)


def probe(out: str, pyspy: str, paths: list[str]) -> None:
    sys.path[:0] = paths
    results: dict[str, dict[str, Any]] = {}

    def check(name: str, fn: Callable[[], object]) -> None:
        try:
            results[name] = {"ok": True, "detail": str(fn())[:500]}
        except Exception as e:  # every check reports, whatever fails
            results[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}"[:800]}

    def dump(unit: str, native: bool) -> str:
        pid = engine_pid(unit)
        said = run([pyspy, "dump", "--json", "--pid", str(pid), *(["--native"] if native else [])])
        if "engine_marker_loop" not in said:
            raise AssertionError(f"pid {pid}: no engine_marker_loop frame in {said[-300:]}")
        return f"pid {pid}: stacks read"

    def own_status() -> str:
        keys = ("CapBnd", "CapEff", "NoNewPrivs", "Seccomp")
        status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith(keys))
        return json.dumps({k: status[k].strip() for k in keys})

    check("own status", own_status)
    for unit in ENGINES:
        check(f"py-spy {unit}", lambda unit=unit: dump(unit, False))  # type: ignore[misc]
        if unit != "engine-container.service":  # --native across PID namespaces fails unsandboxed too (py-spy)
            check(f"py-spy --native {unit}", lambda unit=unit: dump(unit, True))  # type: ignore[misc]

    def container_files() -> str:
        pid = engine_pid("engine-container.service")
        exe = os.readlink(f"/proc/{pid}/exe")
        if os.path.exists(exe) or not os.path.exists(f"/proc/{pid}/root{exe}"):
            raise AssertionError(f"{exe}: should be only in the container's mount namespace")
        return f"{exe} through /proc/{pid}/root"

    check("a container's files through /proc/PID/root", container_files)
    check("signal another user's process", lambda: os.kill(engine_pid("engine-user.service"), 0))  # a step's kill
    check("another user's environ", lambda: len(Path(f"/proc/{engine_pid('engine-user.service')}/environ")
                                                 .read_bytes()))

    def restart_unit() -> str:
        before = main_pid("target.service")
        run(["systemctl", "--no-ask-password", "restart", "--", "target.service"])
        after = main_pid("target.service")
        if after in (0, before):
            raise AssertionError(f"MainPID {before} -> {after}")
        return f"target.service MainPID {before} -> {after}"

    check("systemctl restart", restart_unit)
    check("docker restart", lambda: run(["docker", "restart", "--time", "5", "vllm"]))
    check("journalctl", lambda: run(["journalctl", "--no-pager", "-n", "5", "-u", "target.service"]))

    def sweep() -> str:
        from watchdog.act.shm_sweep import LocalShm
        report = LocalShm(remove=True)()
        if report.error or ("psm_probe", 4096) not in report.removed:
            raise AssertionError(str(report))
        return str(report)

    check("/dev/shm sweep of another user's segment", sweep)

    def fr_pipe() -> str:
        fd = os.open("/run/probe/fr_pipe_0", os.O_WRONLY | os.O_NONBLOCK)
        try:
            return f"wrote {os.write(fd, b'1')} byte"
        finally:
            os.close(fd)

    check("the Flight Recorder pipe (on the read-only /run)", fr_pipe)

    def ptrace_preflight() -> object:
        from watchdog.host.ptrace import attach_check
        allowed, why = attach_check()
        if not allowed:
            raise AssertionError(why)
        return why

    check("ptrace preflight", ptrace_preflight)

    def ssh() -> str:
        from watchdog.config.nodes import NodeSection
        from watchdog.nodes.transport import NodeLink
        link = NodeLink(NodeSection(name="peer", host="127.0.0.1", port=2222, identity_file="/run/probe/id",
                                    known_hosts_file="/run/probe/known_hosts"))
        try:
            link.connect()  # the shared connection: its socket in the unit's own /tmp
            return run(link.verb_argv("echo ssh-ok"))
        finally:
            link.close()

    check("ssh through a shared connection", ssh)
    if Path("/dev/nvidiactl").exists():  # a GPU host: the watchdog's own NVML reading, through /dev/nvidia*
        def nvml() -> str:
            from watchdog.evidence.gpu.nvml import NvmlSource
            source = NvmlSource()
            if why := source.open():
                raise AssertionError(why)
            samples = source.sample()
            if not samples:
                raise AssertionError("NVML opened but gave no sample")
            return f"{len(samples)} GPU(s): {samples[0]}"

        check("NVML", nvml)
    Path(out).write_text(json.dumps(results, indent=1))


def engine_marker_loop() -> None:
    while True:
        time.sleep(0.2)


def engine(args: list[str]) -> None:
    if "--shm" in args:  # a segment no process has open or mapped: stale
        fd = os.open(SHM_SEGMENT, os.O_CREAT | os.O_WRONLY, 0o600)
        os.write(fd, b"\0" * 4096)
        os.close(fd)
    if "--fifo" in args:
        path = args[args.index("--fifo") + 1]
        os.mkfifo(path, 0o600)

        def read() -> None:
            while True:
                with open(path, "rb") as f:
                    f.read()

        threading.Thread(target=read, daemon=True).start()
    engine_marker_loop()


def container() -> None:
    os.makedirs(CONTAINER_USR, exist_ok=True)
    subprocess.run(["mount", "--bind", "/usr", CONTAINER_USR], check=True, timeout=30)
    python = f"{CONTAINER_USR}/bin/python3"
    os.execv(python, [python, __file__, "engine"])


class _DockerApi(http.server.BaseHTTPRequestHandler):
    log_path = ""

    def _answer(self, code: int, body: bytes = b"") -> None:
        # logged before the answer: once the client has its answer the test may read the log
        with open(self.log_path, "a") as f:
            f.write(f"{self.command} {self.path}\n")
        self.send_response(code)
        self.send_header("Api-Version", "1.41")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._answer(200)

    def do_GET(self) -> None:
        self._answer(200, b"OK")

    def do_POST(self) -> None:
        self._answer(204)

    def address_string(self) -> str:
        return "unix"


def dockerd(socket_path: str) -> None:
    _DockerApi.log_path = socket_path + ".log"
    Path(socket_path).unlink(missing_ok=True)
    socketserver.UnixStreamServer(socket_path, _DockerApi).serve_forever()


if __name__ == "__main__":
    verb, rest = sys.argv[1], sys.argv[2:]
    if verb == "probe":
        probe(rest[0], rest[1], rest[2:])
    elif verb == "engine":
        engine(rest)
    elif verb == "container":
        container()
    elif verb == "dockerd":
        dockerd(rest[0])
    else:
        raise SystemExit(__doc__)
