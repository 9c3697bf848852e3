"""nginx (open source: no active health checks) acting on the watchdog's /readyz through deploy/nginx: the shipped
server block and readyz-upstreams.sh, a real nginx, two real `watchdog run`, two fake engines. One engine freezes
(work pending, nothing moves, a generation gets no answer): once its watchdog says frozen, the loop marks it down and
reloads nginx, and no request starts on it after; when it moves again it is back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests

from tests.fakes import FAST, EngineModel, fake_engine, wait_for
from tests.harness.server import free_port
from tests.harness.watcher import WatchdogProcess
from tests.unit.test_act_daemon import freeze

ROOT = Path(__file__).resolve().parents[2]
NGINX = "/usr/sbin/nginx"


def started(procs: list[subprocess.Popen[bytes]], argv: list[str], log: Path, **kw: object) -> None:
    with open(log, "ab") as out:
        procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True, **kw))  # type: ignore[call-overload]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes this test starts, each in its own session: ended by their own group in teardown."""
    out: list[subprocess.Popen[bytes]] = []
    yield out
    for p in reversed(out):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def nginx_conf(tmp: Path, port: int, upstream: Path) -> Path:
    server = (ROOT / "deploy" / "nginx" / "vllm.conf").read_text()
    assert "listen 127.0.0.1:8080;" in server and "/etc/nginx/vllm-upstream.conf" in server
    server = server.replace("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{port};").replace(
        "/etc/nginx/vllm-upstream.conf", str(upstream))
    temp = "".join(f"{k}_temp_path {tmp / k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = tmp / "nginx.conf"
    conf.write_text(f"""daemon off;
worker_processes 1;
pid {tmp / 'nginx.pid'};
error_log {tmp / 'error.log'} notice;
events {{ worker_connections 256; }}
http {{
    log_format lb '$pid $upstream_addr $status';
    access_log {tmp / 'access.log'} lb;
    {temp}
{server}
}}
""")
    return conf


def served(log: Path) -> list[tuple[int, str]]:
    """(nginx worker pid, upstream address) of each request nginx logged."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, upstream, _status = line.split()
        out.append((int(pid), upstream))
    return out


def generations(tmp: Path) -> list[tuple[int, str]]:
    """(worker pid, the upstream block it runs with) for nginx's start and each reload, in order: the first worker
    runs the block written before the start, each reload's worker the block the loop wrote for that reload."""
    pids = [int(p) for p in re.findall(r"start worker process (\d+)", (tmp / "error.log").read_text())]
    blocks = [(tmp / "initial-upstream").read_text()] + [
        line.split(" ", 1)[1] for line in (tmp / "sync.log").read_text().splitlines() if "upstream" in line]
    return list(zip(pids, blocks, strict=False))  # a reload being made may be in one log and not yet the other


def down_workers(tmp: Path, addr: str) -> set[int]:
    return {pid for pid, block in generations(tmp) if f"{addr} down" in block}


def out_workers(tmp: Path, out: str, others: list[str]) -> set[int]:
    """The workers running with ``out`` marked down and every other engine up (nginx's first worker runs the block
    written before the start, with every engine down: not the one under test)."""
    return down_workers(tmp, out) - set().union(*(down_workers(tmp, a) for a in others))


def test_nginx_follows_the_watchdogs_readyz(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    with ExitStack() as stack:
        engines = [stack.enter_context(fake_engine(EngineModel(gen=10, prompt=10))) for _ in range(2)]
        addrs = [url.removeprefix("http://") for url, _ in engines]
        wd_ports = [free_port() for _ in engines]
        watchdogs = []
        for i, ((url, _), port) in enumerate(zip(engines, wd_ports, strict=True)):
            w = WatchdogProcess(url, tmp_path / f"wd{i}", FAST.replace("port = 0", f"port = {port}"), port)
            watchdogs.append(w.start())
            stack.callback(w.stop)
        upstream = tmp_path / "vllm-upstream.conf"
        upstream.write_text("upstream vllm {\n" + "".join(f"    server {a} down;\n" for a in addrs) + "}\n")
        (tmp_path / "initial-upstream").write_text(upstream.read_text())
        port = free_port()
        conf = nginx_conf(tmp_path, port, upstream)
        nginx = [NGINX, "-p", str(tmp_path), "-c", str(conf)]
        started(procs, nginx, tmp_path / "nginx.out")
        wait_for((tmp_path / "nginx.pid").exists, 20, "nginx up")
        env = dict(os.environ, INTERVAL="0.5", RELOAD=" ".join([*nginx, "-s", "reload"]))
        started(procs, [str(ROOT / "deploy" / "nginx" / "readyz-upstreams.sh"), str(upstream), "vllm",
                        *(f"{a}=http://127.0.0.1:{p}/readyz" for a, p in zip(addrs, wd_ports, strict=True))],
                tmp_path / "sync.log", env=env)
        wait_for(lambda: "down" not in upstream.read_text(), 30, "both engines in the upstream once idle")

        stop = threading.Event()
        answers: list[int] = []

        def client() -> None:
            with requests.Session() as s:
                while not stop.is_set():
                    try:
                        r = s.post(f"http://127.0.0.1:{port}/v1/completions", timeout=3,
                                   json={"model": "fake", "prompt": "x", "max_tokens": 1})
                        answers.append(r.status_code)
                    except requests.RequestException:
                        answers.append(0)
                    stop.wait(0.05)

        clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
        for t in clients:
            t.start()
        try:
            log = tmp_path / "access.log"
            wait_for(lambda: {u for _, u in served(log)} >= set(addrs), 30, "requests reach both engines")
            freeze(engines[1][1])
            wait_for(lambda: f"server {addrs[1]} down;" in upstream.read_text(), 30, "the frozen engine marked down")
            assert watchdogs[1].current() == "frozen"
            wait_for(lambda: any(pid in out_workers(tmp_path, addrs[1], addrs[:1]) for pid, _ in served(log)), 30,
                     "the workers of that reload serving")
            # restarted (a new incarnation, as a restart step would make it), the hung requests let go
            requests.post(f"{engines[1][0]}/_control/restart", timeout=10).raise_for_status()
            engines[1][1].release.set()
            wait_for(lambda: "down" not in upstream.read_text(), 30, "back once it moves again")
            wait_for(lambda: served(log)[-20:].count((max(p for p, _ in generations(tmp_path)), addrs[1])) > 0, 30,
                     "serving again")
        finally:
            stop.set()
            for t in clients:
                t.join(10)
    # every worker started while the frozen engine was marked down served the other one only, and some did
    def reloads_settled() -> bool:  # the loop may be between its reload and its log line: wait for both
        pids = re.findall(r"start worker process (\d+)", (tmp_path / "error.log").read_text())
        blocks = (tmp_path / "sync.log").read_text().count("upstream") + 1
        return len(pids) == blocks

    wait_for(reloads_settled, 10, "one worker for the start and each reload")
    frozen_out = out_workers(tmp_path, addrs[1], addrs[:1])
    by_them = [u for pid, u in served(tmp_path / "access.log") if pid in frozen_out]
    assert by_them and set(by_them) == {addrs[0]}, by_them


def test_a_failed_reload_is_tried_again(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """The block is kept only once a reload succeeded: a failed reload puts the previous one back, and the next
    round writes it and reloads again (before: the new block stayed in place, and no round ever reloaded again)."""
    out, calls, reload = tmp_path / "upstream.conf", tmp_path / "reloads", tmp_path / "reload.sh"
    out.write_text("upstream vllm {\n    server 127.0.0.1:1 max_fails=0;\n}\n")
    reload.write_text(f'#!/bin/sh\necho x >> {calls}\n[ "$(wc -l < {calls})" -ge 2 ]\n')  # the first one fails
    reload.chmod(0o755)
    script = ROOT / "deploy" / "nginx" / "readyz-upstreams.sh"
    started(procs, ["sh", str(script), str(out), "vllm", f"127.0.0.1:1=http://127.0.0.1:{free_port()}/readyz"],
            tmp_path / "loop.log", env={**os.environ, "INTERVAL": "0.1", "RELOAD": str(reload)})

    def reloads() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    wait_for(lambda: reloads() >= 2, 20, "a second reload after the first failed")
    wait_for(lambda: "server 127.0.0.1:1 down;" in out.read_text(), 5, "the block in place after it")
    time.sleep(0.5)
    assert reloads() == 2  # reloaded once it worked, and not again: nothing changed since
    assert not (tmp_path / "upstream.conf.prev").exists()
    assert "reload failed" in (tmp_path / "loop.log").read_text()
