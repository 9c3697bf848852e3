"""An engine in a container, found from the host: docker-proxy's argv, the tcp tables, a fake /proc tree standing in
for the network namespaces, the choice of the server, `docker inspect` through a fake runner, and discovery over
real process trees (whose namespaces the fake /proc tree describes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from watchdog.evidence.collect import discover as discover_module
from watchdog.evidence.collect.discover import discover, engine_root, server_for_url
from watchdog.evidence.collect.proxy import (
    InitPids,
    ProcFS,
    ProxyTarget,
    local_addresses,
    parse_docker_proxy,
    server_behind_proxy,
    topmost,
)
from watchdog.host.docker_cli import container_pid
from watchdog.host.sockets import Listener, listeners

PROXY_ARGV = ["/usr/bin/docker-proxy", "-proto", "tcp", "-host-ip", "0.0.0.0", "-host-port", "18711",
              "-container-ip", "172.17.0.2", "-container-port", "8000"]

# ---------------------------------------------------------------------------------------------- docker-proxy argv


def test_docker_proxy_argv_is_parsed() -> None:
    assert parse_docker_proxy(PROXY_ARGV) == ProxyTarget("172.17.0.2", 8000, 18711)
    eq = ["docker-proxy", "--proto=tcp", "--host-port=80", "--container-ip=10.0.0.5", "--container-port=8080"]
    assert parse_docker_proxy(eq) == ProxyTarget("10.0.0.5", 8080, 80)
    no_proto = ["/usr/libexec/docker/docker-proxy", "-container-ip", "172.18.0.3", "-container-port", "9000"]
    assert parse_docker_proxy(no_proto) == ProxyTarget("172.18.0.3", 9000, None)


@pytest.mark.parametrize("argv", [
    [], ["/usr/bin/dockerd"], ["python3", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"],
    PROXY_ARGV[:-2],  # no container port
    [*PROXY_ARGV[:-1], "http"], [*PROXY_ARGV[:-1], "70000"], [*PROXY_ARGV[:-1], "0"],
    ["docker-proxy", "-proto", "udp", "-container-ip", "172.17.0.2", "-container-port", "53"],
    ["/tmp/not-docker-proxy", "-container-port", "8000"],
])
def test_not_a_tcp_docker_proxy(argv: list[str]) -> None:
    assert parse_docker_proxy(argv) is None


# ---------------------------------------------------------------------------------------------- /proc/net tables

TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5551 1 0 100 0 0 10 0
   1: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5552 1 0 100 0 0 10 0
   2: 0200007F:1F40 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 5553 1 0 20 4 30 10 -1
   3: garbage
"""
TCP6 = """  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 6661 1 0 100 0 0 10 0
"""  # noqa: E501 - the kernel's line

FIB = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 172.17.0.0/16 2 0 2
        |-- 172.17.0.2
           /32 host LOCAL
        |-- 172.17.255.255
           /32 link BROADCAST
"""


def test_the_listeners_of_a_table_are_its_listen_lines() -> None:
    # the established one on 8000 is not a listener, the garbage line is skipped
    assert listeners(TCP) == [Listener("0.0.0.0", 8000, 5551), Listener("127.0.0.1", 8001, 5552)]
    assert listeners(TCP6) == [Listener("::", 8000, 6661)]
    assert listeners("") == [] and listeners(TCP.splitlines()[0]) == []


def test_local_addresses_from_fib_trie() -> None:
    assert local_addresses(FIB) == {"127.0.0.1", "172.17.0.2"}
    assert local_addresses("") == set()


# ---------------------------------------------------------------------------------------------- a fake /proc tree


@dataclass
class P:
    """One process in the fake /proc: its network namespace, parent, held sockets, and its namespace's tables."""

    netns: str
    ppid: int = 1
    sockets: list[int] = field(default_factory=list)
    tcp: str = ""
    fib: str = ""


def fake_proc(root: Path, procs: dict[int, P]) -> ProcFS:
    """/proc laid out as the kernel does: PID/ns/net (a link), PID/status, PID/fd/N (links), PID/net/{tcp,tcp6,
    fib_trie}."""
    for pid, p in procs.items():
        d = root / str(pid)
        (d / "ns").mkdir(parents=True)
        (d / "fd").mkdir()
        (d / "net").mkdir()
        os.symlink(p.netns, d / "ns" / "net")
        (d / "status").write_text(f"Name:\tx\nPPid:\t{p.ppid}\n")
        os.symlink("/dev/null", d / "fd" / "0")
        for i, inode in enumerate(p.sockets, start=3):
            os.symlink(f"socket:[{inode}]", d / "fd" / str(i))
        (d / "net" / "tcp").write_text(p.tcp or TCP.splitlines()[0] + "\n")
        (d / "net" / "tcp6").write_text("")
        (d / "net" / "fib_trie").write_text(p.fib)
    (root / "self").mkdir()  # not a pid: never read as one
    return ProcFS(str(root))


def listen_on(port: int, inode: int) -> str:
    return TCP.splitlines()[0] + f"\n   0: 00000000:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 " \
        f"00000000     0        0 {inode} 1 0 100 0 0 10 0\n"


HOST, C1, C2 = "net:[4026531840]", "net:[4026532500]", "net:[4026532600]"


def fib_of(ip: str) -> str:
    return FIB.replace("172.17.0.2", ip)


def test_the_server_is_the_listener_in_the_containers_netns(tmp_path: Path) -> None:
    fs = fake_proc(tmp_path, {
        100: P(HOST, sockets=[11]),  # docker-proxy itself, in the host's namespace
        150: P(HOST, sockets=[12], tcp=listen_on(8000, 12)),  # a bare engine on the host's 8000: not the one
        200: P(C1, ppid=190, sockets=[555], tcp=listen_on(8000, 555), fib=fib_of("172.17.0.2")),  # the API server
        201: P(C1, ppid=200, sockets=[555], tcp=listen_on(8000, 555), fib=fib_of("172.17.0.2")),  # inherited it
        190: P(C1, ppid=1, tcp=listen_on(8000, 555), fib=fib_of("172.17.0.2")),  # the container's init: no socket
    })
    assert server_behind_proxy(100, ProxyTarget("172.17.0.2", 8000), fs) == 200
    assert server_behind_proxy(100, ProxyTarget("172.17.0.2", 8001), fs) is None  # nobody listens there yet


def test_two_containers_on_the_same_port_are_told_apart_by_address(tmp_path: Path) -> None:
    fs = fake_proc(tmp_path, {
        100: P(HOST),
        300: P(C2, sockets=[777], tcp=listen_on(8000, 777), fib=fib_of("172.17.0.3")),
        400: P(C1, sockets=[555], tcp=listen_on(8000, 555), fib=fib_of("172.17.0.2")),
    })
    assert server_behind_proxy(100, ProxyTarget("172.17.0.2", 8000), fs) == 400
    assert server_behind_proxy(100, ProxyTarget("172.17.0.3", 8000), fs) == 300


def test_a_process_that_does_not_hold_the_socket_is_not_the_server(tmp_path: Path) -> None:
    # a sidecar in the container's namespace sees the same table but holds another socket
    fs = fake_proc(tmp_path, {100: P(HOST), 250: P(C1, sockets=[999], tcp=listen_on(8000, 555))})
    assert server_behind_proxy(100, ProxyTarget("172.17.0.2", 8000), fs) is None


def test_unreadable_namespaces_are_skipped(tmp_path: Path) -> None:
    fs = fake_proc(tmp_path, {100: P(HOST), 400: P(C1, sockets=[555], tcp=listen_on(8000, 555))})
    os.unlink(tmp_path / "400" / "ns" / "net")  # what another user's process looks like to a non-root reader
    assert server_behind_proxy(100, ProxyTarget("172.17.0.2", 8000), fs) is None
    assert ProcFS(str(tmp_path / "absent")).pids() == []


def test_topmost_takes_the_holder_without_a_holding_ancestor() -> None:
    parents = {10: 1, 11: 10, 12: 11, 20: 1}
    assert topmost([12, 11, 10], parents.get) == 10
    assert topmost([12, 11], parents.get) == 11
    assert topmost([12, 20], parents.get) == 12  # two unrelated: the lowest pid
    loop = {5: 6, 6: 5}
    assert topmost([5, 6], loop.get) == 5  # a cycle in a racing /proc does not hang


# ---------------------------------------------------------------------------------------------- docker inspect


class Runner:
    def __init__(self, rc: int, out: str, err: str = "") -> None:
        self.rc, self.out, self.err = rc, out, err
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
        self.calls.append((list(argv), timeout))
        return self.rc, self.out, self.err


def test_container_pid_through_docker_inspect() -> None:
    r = Runner(0, "4242\n")
    assert container_pid("vllm-tp2", r, timeout=7.0) == (4242, "")
    assert r.calls == [(["docker", "inspect", "--type", "container", "--format", "{{.State.Pid}}", "--", "vllm-tp2"],
                        7.0)]
    assert container_pid("c", Runner(0, "0\n")) == (None, "container c is not running")
    pid, why = container_pid("gone", Runner(1, "", "Error: No such object: gone\n"))
    assert pid is None and why == "docker inspect gone: Error: No such object: gone"
    pid, why = container_pid("c", Runner(124, "", ""))
    assert pid is None and "exit status 124" in why
    pid, why = container_pid("c", Runner(0, "<no value>\n"))
    assert pid is None and "not a pid" in why


def test_init_pids_asks_docker_once_per_container_start() -> None:
    starts = {4242: 100.0}
    pids = InitPids(started=starts.get)
    r = Runner(0, "4242\n")
    assert pids("c", r) == (4242, "") and pids("c", r) == (4242, "")
    assert len(r.calls) == 1  # remembered while the same process lives
    starts[4242] = 200.0  # the number reused by another process: asked again
    assert pids("c", r) == (4242, "") and len(r.calls) == 2
    del starts[4242]  # the container stopped: asked again, and a failure is not remembered
    gone = Runner(1, "", "Error: No such object: c")
    assert pids("c", gone)[0] is None and pids("c", gone)[0] is None and len(gone.calls) == 2


# ---------------------------------------------------------------------------------------------- real trees

# fork and exec, not subprocess: with a title for argv[0] Python cannot find its extension modules
_TREE = """
import json, os, sys, time
for k in json.loads(sys.argv[1]):
    if os.fork() == 0:
        os.execv(os.environ["WDT_PY"], [k["argv"][0], "-c", os.environ["WDT_TREE"], json.dumps(k["kids"]),
                                        *k["argv"][1:]])
time.sleep(60)
"""


@dataclass
class Tree:
    top: subprocess.Popen[bytes]
    pids: dict[str, int]  # the first word of each process's argv (unique in a test) -> pid


@pytest.fixture
def trees() -> Iterator[Any]:
    """Start real process trees (each its own session, ended by its group id); argv[0] is the title."""
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], kids: list[dict[str, Any]], count: int) -> Tree:
        env = {**os.environ, "WDT_TREE": _TREE, "WDT_PY": sys.executable}
        p = subprocess.Popen([argv[0], "-c", _TREE, json.dumps(kids), *argv[1:]], executable=sys.executable,
                             env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(p)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
            try:
                pids = {q.cmdline()[0]: q.pid for q in procs}
            except (psutil.Error, IndexError):
                continue
            if len(pids) == count:
                return Tree(p, pids)
            time.sleep(0.05)
        raise AssertionError(f"the tree under {p.pid} never reached {count} processes")

    yield start
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def node(title: str, *kids: dict[str, Any], args: Sequence[str] = ()) -> dict[str, Any]:
    return {"argv": [title, *args], "kids": list(kids)}


@pytest.fixture
def prefix() -> str:
    return f"WDD{os.getpid()}x::"


def engine(prefix: str) -> list[dict[str, Any]]:
    return [node(prefix + "EngineCore", node(prefix + "Worker_TP0"), node(prefix + "Worker_TP1"))]


def test_discover_through_docker_proxy_finds_every_rank(tmp_path: Path, trees: Any, prefix: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = trees(["docker-proxy", *PROXY_ARGV[1:]], [], 1)
    server = trees(["vllm-api", "vllm.entrypoints.openai.api_server"], engine(prefix), 4)
    srv = server.pids["vllm-api"]
    fs = fake_proc(tmp_path, {proxy.top.pid: P(HOST, sockets=[1]),
                              srv: P(C1, sockets=[555], tcp=listen_on(8000, 555), fib=fib_of("172.17.0.2"))})
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: proxy.top.pid)
    found = discover("http://127.0.0.1:18711", prefix=prefix, fs=fs)
    assert [(p.role, p.pid) for p in found] == [
        ("api_server", srv), ("engine_core", server.pids[prefix + "EngineCore"]),
        ("worker", server.pids[prefix + "Worker_TP0"]), ("worker", server.pids[prefix + "Worker_TP1"])]
    # before the change the proxy's own (empty) tree was taken: the proxy is nowhere in the answer
    assert proxy.top.pid not in {p.pid for p in found}


def test_a_plain_listener_is_still_the_server(trees: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--network host, or a bare engine: the listener is the API server and its tree the engine, as before."""
    server = trees(["vllm-api", "vllm.entrypoints.openai.api_server"], engine(prefix), 4)
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: server.top.pid)
    calls = Runner(0, "1\n")
    found = discover("http://127.0.0.1:8000", prefix=prefix, container="named", runner=calls)
    assert [p.role for p in found] == ["api_server", "engine_core", "worker", "worker"]
    assert found[0].pid == server.top.pid and calls.calls == []  # the container's name was not needed


def test_proxy_off_the_named_containers_init_tree(trees: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    init = trees(["docker-init"], [node("vllm-api", *engine(prefix), args=["vllm.entrypoints.openai.api_server"])],
                 5)
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: None)
    runner = Runner(0, f"{init.top.pid}\n")
    found = discover("http://127.0.0.1:18711", prefix=prefix, container="vllm-off", runner=runner)
    assert [(p.role, p.pid) for p in found] == [
        ("api_server", init.pids["vllm-api"]), ("engine_core", init.pids[prefix + "EngineCore"]),
        ("worker", init.pids[prefix + "Worker_TP0"]), ("worker", init.pids[prefix + "Worker_TP1"])]
    assert runner.calls[0][0][-1] == "vllm-off"
    assert engine_root(None, "vllm-off", runner) == (init.top.pid, False)  # the agent's way: no URL, a name


def test_proxy_off_dockerd_holding_the_port_is_not_the_server(trees: Any, prefix: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Docker 20.10 with --userland-proxy=false: dockerd itself listens on the published port (to reserve it; the NAT
    # takes the traffic): seen live in tests/engine/test_docker.py. It is not the API server: the named container is.
    daemon = trees(["dockerd", "--userland-proxy=false"], [], 1)
    init = trees(["docker-init"], [node("vllm-api", *engine(prefix), args=["vllm.entrypoints.openai.api_server"])],
                 5)
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: daemon.top.pid)
    found = discover("http://127.0.0.1:18711", prefix=prefix, container="vllm-off",
                     runner=Runner(0, f"{init.top.pid}\n"))
    assert [(p.role, p.pid) for p in found][:2] == [("api_server", init.pids["vllm-api"]),
                                                    ("engine_core", init.pids[prefix + "EngineCore"])]
    assert daemon.top.pid not in {p.pid for p in found}


def test_proxy_off_container_gone_falls_back_to_titles(trees: Any, prefix: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    loose = trees([prefix + "Worker_TP0"], [], 1)
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: None)
    found = discover("http://127.0.0.1:18711", prefix=prefix, container="gone",
                     runner=Runner(1, "", "Error: No such object: gone"))
    assert [p.pid for p in found] == [loose.top.pid]


def test_server_for_url_uses_the_container_port_in_another_netns(tmp_path: Path, trees: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = trees(["docker-proxy", *PROXY_ARGV[1:]], [], 1)
    inside = trees(["vllm-in", "vllm.entrypoints.openai.api_server", "--port", "8000"], [], 1)
    bare = trees(["vllm-bare", "vllm.entrypoints.openai.api_server", "--port", "8000"], [], 1)
    other = trees(["vllm-other", "vllm.entrypoints.openai.api_server", "--port", "18711"], [], 1)
    fs = fake_proc(tmp_path, {proxy.top.pid: P(HOST), bare.top.pid: P(HOST), other.top.pid: P(HOST),
                              inside.top.pid: P(C1)})
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: proxy.top.pid)
    tree = server_for_url("http://127.0.0.1:18711", fs=fs)
    assert tree is not None and tree.pid == inside.top.pid  # port 8000 (the container's), not 18711, not the host's


def test_server_for_url_default_port_inside(tmp_path: Path, trees: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = trees(["docker-proxy", *PROXY_ARGV[1:]], [], 1)
    inside = trees(["vllm-in", "vllm.entrypoints.openai.api_server"], [], 1)  # no --port: vLLM's 8000
    fs = fake_proc(tmp_path, {proxy.top.pid: P(HOST), inside.top.pid: P(C1)})
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: proxy.top.pid)
    tree = server_for_url("http://127.0.0.1:18711", fs=fs)
    assert tree is not None and tree.pid == inside.top.pid


def test_server_for_url_proxy_off_named_container(trees: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    init = trees(["docker-init"], [node("vllm-in", args=["vllm.entrypoints.openai.api_server", "--port", "9"])],
                 2)
    monkeypatch.setattr(discover_module, "listener_pid", lambda url: None)
    tree = server_for_url("http://127.0.0.1:18711", "vllm-booting", Runner(0, f"{init.top.pid}\n"))
    assert tree is not None and tree.pid == init.pids["vllm-in"]  # any port: the published one is not its own
    assert server_for_url("http://127.0.0.1:18711", "vllm-absent", Runner(1, "", "no such")) is None
