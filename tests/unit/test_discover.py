"""Process discovery: title parsing, the server behind a port (fakes), and discovery of real titled processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import psutil
import pytest

from watchdog.core.processes import EngineProcess
from watchdog.core.roles import parse_title
from watchdog.evidence.collect.discover import discover, server_for_port

SLEEP = "import time; time.sleep(30)"

# ---------------------------------------------------------------------------------------------- parse_title


@pytest.mark.parametrize(("title", "expected"), [
    ("VLLM::EngineCore", ("engine_core", {})),
    ("VLLM::EngineCore_DP1", ("engine_core", {"DP": 1})),
    ("VLLM::Worker", ("worker", {})),
    ("VLLM::Worker_TP1", ("worker", {"TP": 1})),
    ("VLLM::Worker_DP0_PP1_TP3_EP2", ("worker", {"DP": 0, "PP": 1, "TP": 3, "EP": 2})),
    ("VLLM::Worker_TP12 -c import time", ("worker", {"TP": 12})),  # only the first word is the title
    ("VLLM::APIServer_0", ("api_server", {})),
    ("VLLM::DPCoordinator", ("dp_coordinator", {})),
    ("VLLM::SomethingNew", ("process", {})),
    ("sglang::scheduler_DP1_TP3", ("scheduler", {"DP": 1, "TP": 3})),
    ("sglang::scheduler", ("scheduler", {})),
    ("ray::RayWorkerWrapper", ("worker", {})),
    ("ray::RayWorkerWrapper.execute_method", ("worker", {})),
])
def test_parse_title_engine_titles(title: str, expected: tuple[str, dict[str, int]]) -> None:
    assert parse_title(title) == expected


def test_parse_title_custom_prefix() -> None:
    assert parse_title("MYCO::Worker_TP2", prefix="MYCO::") == ("worker", {"TP": 2})
    assert parse_title("MYCO::EngineCore_DP3", prefix="MYCO::") == ("engine_core", {"DP": 3})
    assert parse_title("MYCO::Worker_TP2") is None  # the default prefix does not see it
    assert parse_title("VLLM::Worker_TP2", prefix="MYCO::") is None


@pytest.mark.parametrize("title", [
    "", "python -m vllm.entrypoints.openai.api_server --port 8000", "vllm serve m --port 8000",
    "/usr/bin/python3 -m pytest", "ray::IDLE", "ray::_StatsActor", "sshd: root@pts/0", "xVLLM::Worker_TP1",
    "sglang::detokenizer", "bash -c VLLM::Worker_TP1",
])
def test_parse_title_non_engine_titles(title: str) -> None:
    assert parse_title(title) is None


# ---------------------------------------------------------------------------------------------- fakes


@dataclass
class FakeProc:
    """The slice of psutil.Process that discover uses."""

    pid: int
    argv: list[str]
    kids: list[FakeProc] = field(default_factory=list)
    parent: int = 1
    started: float = 1_700_000_000.0
    denied: bool = False

    def cmdline(self) -> list[str]:
        if self.denied:
            raise psutil.AccessDenied(self.pid)
        return list(self.argv)

    def create_time(self) -> float:
        return self.started

    def ppid(self) -> int:
        return self.parent

    def children(self, recursive: bool = False) -> list[FakeProc]:
        out: list[FakeProc] = []
        for k in self.kids:
            out.append(k)
            if recursive:
                out += k.children(recursive=True)
        return out


def procs(*ps: FakeProc) -> list[psutil.Process]:
    return cast(list[psutil.Process], list(ps))


def engine_tree(pid: int, argv: list[str]) -> FakeProc:
    w0 = FakeProc(pid + 3, ["VLLM::Worker_TP0"], parent=pid + 2)
    w1 = FakeProc(pid + 4, ["VLLM::Worker_TP1", ""], parent=pid + 2)
    core = FakeProc(pid + 2, ["VLLM::EngineCore"], [w0, w1], parent=pid)
    tracker = FakeProc(pid + 1, [sys.executable, "-c", "from multiprocessing.resource_tracker import main;main(31)"],
                       parent=pid)
    return FakeProc(pid, argv, [tracker, core], started=1_700_000_123.5)


# ---------------------------------------------------------------------------------------------- server_for_port


def test_server_for_port_by_port_flag() -> None:
    other = engine_tree(100, ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8001"])
    mine = engine_tree(200, ["/venv/bin/vllm", "serve", "/models/m", "--host", "127.0.0.1", "--port", "8002"])
    tree = server_for_port("http://127.0.0.1:8002", procs(other, mine))
    assert tree is not None
    assert tree.pid == 200
    assert tree.started == 1_700_000_123.5
    assert tree.titles == ("VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1")
    assert server_for_port("http://127.0.0.1:8001", procs(other, mine)).pid == 100  # type: ignore[union-attr]
    assert server_for_port("http://127.0.0.1:8003", procs(other, mine)) is None


def test_server_for_port_equals_form() -> None:
    p = FakeProc(300, ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port=8005"])
    tree = server_for_port("http://localhost:8005/", procs(p))
    assert tree is not None and tree.pid == 300 and tree.titles == ()
    assert server_for_port("http://localhost:8000/", procs(p)) is None  # an explicit port is not the default


def test_server_for_port_default_8000() -> None:
    p = FakeProc(400, ["vllm", "serve", "m"])
    assert server_for_port("http://127.0.0.1:8000", procs(p)) is not None
    assert server_for_port("http://127.0.0.1:8001", procs(p)) is None


def test_server_for_port_ignores_non_vllm_process_on_the_port() -> None:
    http = FakeProc(500, ["python", "-m", "http.server", "--port", "8006"])
    node = FakeProc(501, ["node", "app.js", "--port=8006"])
    assert server_for_port("http://127.0.0.1:8006", procs(http, node)) is None
    real = FakeProc(502, ["vllm", "serve", "m", "--port", "8006"])
    tree = server_for_port("http://127.0.0.1:8006", procs(http, node, real))
    assert tree is not None and tree.pid == 502


def test_server_for_port_titled_child_is_not_the_server() -> None:
    # EngineCore's command line is its title; it says "vllm" and has no --port (so "default 8000") but is a child.
    core = FakeProc(601, ["VLLM::EngineCore"], parent=600)
    worker = FakeProc(602, ["VLLM::Worker_TP0", "--port", "8000"], parent=601)
    assert server_for_port("http://127.0.0.1:8000", procs(core, worker)) is None
    server = FakeProc(600, ["python3", "-m", "vllm.entrypoints.openai.api_server"], [core])
    tree = server_for_port("http://127.0.0.1:8000", procs(core, worker, server))
    assert tree is not None and tree.pid == 600 and tree.titles == ("VLLM::EngineCore",)


def test_server_for_port_skips_unreadable_and_empty() -> None:
    denied = FakeProc(700, ["vllm", "serve", "m"], denied=True)
    kernel = FakeProc(2, [])  # kernel threads have an empty command line
    ok = FakeProc(701, ["vllm", "serve", "m"])
    tree = server_for_port("http://127.0.0.1:8000", procs(denied, kernel, ok))
    assert tree is not None and tree.pid == 701


def test_server_for_port_children_titles_only_titled_and_deduplicated() -> None:
    kids = [FakeProc(801, ["VLLM::Worker"]), FakeProc(802, ["VLLM::Worker"]), FakeProc(803, ["VLLM::DPCoordinator"]),
            FakeProc(804, ["/usr/bin/python3", "-c", "x"]), FakeProc(805, ["VLLM::EngineCore_DP1", "padding"])]
    server = FakeProc(800, ["vllm", "serve", "m", "--port", "9000"], kids)
    tree = server_for_port("http://h:9000", procs(server))
    assert tree is not None
    assert tree.titles == ("VLLM::DPCoordinator", "VLLM::EngineCore_DP1", "VLLM::Worker")


# ---------------------------------------------------------------------------------------------- discover (fakes)


def test_discover_with_fake_processes_orders_and_parses() -> None:
    fakes = [
        FakeProc(15, ["VLLM::Worker_TP10"], parent=11),
        FakeProc(14, ["VLLM::Worker_TP1"], parent=11),
        FakeProc(13, ["VLLM::Worker_TP0"], parent=11),
        FakeProc(12, ["VLLM::DPCoordinator"], parent=10),
        FakeProc(11, ["VLLM::EngineCore"], parent=10),
        FakeProc(10, ["VLLM::APIServer_0"], parent=1),
        FakeProc(9, ["bash"]),
        FakeProc(8, ["VLLM::Worker_TP2"], denied=True),  # unreadable: skipped, not fatal
    ]
    found = discover(processes=procs(*fakes))
    assert [(p.pid, p.role) for p in found] == [
        (10, "api_server"), (12, "dp_coordinator"), (11, "engine_core"), (13, "worker"), (14, "worker"),
        (15, "worker")]
    assert found[3] == EngineProcess(13, "worker", "VLLM::Worker_TP0", {"TP": 0}, 11)
    assert found[1].label == "VLLM::DPCoordinator"


def test_discover_orders_multi_dimensional_ranks() -> None:
    fakes = [FakeProc(20 + i, [f"VLLM::Worker_DP{dp}_TP{tp}"]) for i, (dp, tp) in enumerate([(1, 1), (0, 1), (1, 0),
                                                                                               (0, 0)])]
    found = discover(processes=procs(*fakes, FakeProc(30, ["VLLM::EngineCore_DP1"]),
                                     FakeProc(31, ["VLLM::EngineCore_DP0"])))
    assert [p.title for p in found] == ["VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1", "VLLM::Worker_DP0_TP0",
                                        "VLLM::Worker_DP0_TP1", "VLLM::Worker_DP1_TP0", "VLLM::Worker_DP1_TP1"]


def test_discover_title_filter_keeps_api_server() -> None:
    fakes = [FakeProc(40, ["VLLM::APIServer_0"]), FakeProc(41, ["VLLM::EngineCore_DP0"]),
             FakeProc(42, ["VLLM::EngineCore_DP1"]), FakeProc(43, ["VLLM::Worker_DP1_TP0"])]
    found = discover(processes=procs(*fakes), title_filter="_DP1")
    assert [p.pid for p in found] == [40, 42, 43]
    assert discover(processes=procs(*fakes), title_filter="nothing-matches") == [found[0]]


def test_discover_unparsable_ppid_is_none() -> None:
    class NoParent(FakeProc):
        def ppid(self) -> int:
            raise psutil.NoSuchProcess(self.pid)

    found = discover(processes=procs(NoParent(50, ["VLLM::EngineCore"])))
    assert found == [EngineProcess(50, "engine_core", "VLLM::EngineCore", {}, None)]


# ---------------------------------------------------------------------------------------------- real processes


def _wait_title(pid: int, title: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            cmd = []
        if cmd and cmd[0] == title:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never showed the title {title!r}")


def _end(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(timeout=10)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"WDT{os.getpid()}x::"  # unique to this run: the host also runs a real vLLM with VLLM:: titles


@pytest.fixture(scope="module")
def titled(prefix: str) -> Iterator[dict[str, int]]:
    """Real sleepers whose argv[0] is an engine title, started out of order; title -> pid."""
    names = ["Worker_TP1", "EngineCore", "Worker_TP0", "APIServer_0", "DPCoordinator"]
    started: list[subprocess.Popen[bytes]] = []
    try:
        for n in names:
            started.append(subprocess.Popen([prefix + n, "-c", SLEEP], executable=sys.executable,
                                            start_new_session=True, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        for n, p in zip(names, started, strict=True):
            _wait_title(p.pid, prefix + n)
        yield {prefix + n: p.pid for n, p in zip(names, started, strict=True)}
    finally:
        for p in started:
            _end(p)


def test_discover_real_processes_by_host_scan(prefix: str, titled: dict[str, int]) -> None:
    found = discover(prefix=prefix)
    assert [p.title for p in found] == [prefix + t for t in
                                        ("APIServer_0", "DPCoordinator", "EngineCore", "Worker_TP0", "Worker_TP1")]
    assert [p.pid for p in found] == [titled[p.title] for p in found]
    assert [p.role for p in found] == ["api_server", "dp_coordinator", "engine_core", "worker", "worker"]
    assert found[4].ranks == {"TP": 1}
    assert all(p.ppid == os.getpid() for p in found)


def test_discover_real_processes_given_explicitly(prefix: str, titled: dict[str, int]) -> None:
    chosen = [psutil.Process(titled[prefix + "Worker_TP1"]), psutil.Process(titled[prefix + "EngineCore"]),
              psutil.Process(os.getpid())]  # pytest itself: not an engine title
    found = discover(prefix=prefix, processes=chosen)
    assert [(p.role, p.pid) for p in found] == [("engine_core", titled[prefix + "EngineCore"]),
                                                 ("worker", titled[prefix + "Worker_TP1"])]


def test_discover_real_processes_title_filter(prefix: str, titled: dict[str, int]) -> None:
    found = discover(prefix=prefix, title_filter="Worker")
    assert [p.title for p in found] == [prefix + "APIServer_0", prefix + "Worker_TP0", prefix + "Worker_TP1"]


def test_discover_real_vllm_titles_on_the_host(titled: dict[str, int]) -> None:
    """With the real VLLM:: prefix the host scan finds our titled sleeper (and maybe other engines: not asserted)."""
    p = subprocess.Popen(["VLLM::Worker_DP7_TP5", "-c", SLEEP], executable=sys.executable, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_title(p.pid, "VLLM::Worker_DP7_TP5")
        mine = [e for e in discover() if e.pid == p.pid]
        assert mine == [EngineProcess(p.pid, "worker", "VLLM::Worker_DP7_TP5", {"DP": 7, "TP": 5}, os.getpid())]
        filtered = discover(title_filter="Worker_DP7_TP5")
        assert [e.pid for e in filtered if e.role != "api_server"] == [p.pid]
    finally:
        _end(p)
    assert not [e for e in discover() if e.pid == p.pid]


_LISTENER = """
import socket, subprocess, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
kids = [subprocess.Popen([t, "-c", "import time; time.sleep(30)"], executable=sys.executable) for t in sys.argv[1:]]
print(s.getsockname()[1], *[k.pid for k in kids], flush=True)
time.sleep(30)
"""


@pytest.fixture
def listener() -> Iterator[Any]:
    """Start a loopback listener (a stand-in API server) with titled children; yields a starter."""
    started: list[tuple[subprocess.Popen[str], list[int]]] = []

    def start(*titles: str) -> tuple[int, int, list[int]]:
        p = subprocess.Popen([sys.executable, "-c", _LISTENER, *titles], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
        assert p.stdout is not None
        first = p.stdout.readline().split()
        port, kids = int(first[0]), [int(x) for x in first[1:]]
        started.append((p, kids))
        for pid, t in zip(kids, titles, strict=True):
            _wait_title(pid, t)
        return p.pid, port, kids

    yield start
    for p, kids in started:
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _end(cast(subprocess.Popen[bytes], p))
        if p.stdout is not None:
            p.stdout.close()


def test_discover_by_listener_takes_its_tree_only(prefix: str, titled: dict[str, int], listener: Any) -> None:
    root, port, kids = listener(prefix + "Worker_TP1", prefix + "EngineCore", prefix + "Worker_TP0")
    found = discover(f"http://127.0.0.1:{port}", prefix=prefix)
    # the plain-titled listener is the API server; the module's other titled sleepers are not under it
    assert [(p.role, p.pid) for p in found] == [("api_server", root), ("engine_core", kids[1]), ("worker", kids[2]),
                                                ("worker", kids[0])]
    assert found[0].title == "" and found[0].label == f"api_server[{root}]"
    assert not {p.pid for p in found} & set(titled.values())


def test_discover_listener_without_engine_children(prefix: str, titled: dict[str, int], listener: Any) -> None:
    root, port, _ = listener()
    found = discover(f"http://127.0.0.1:{port}", prefix=prefix)
    assert [(p.role, p.pid) for p in found] == [("api_server", root)]


def test_discover_url_nobody_listens_falls_back_to_host_scan(prefix: str, titled: dict[str, int]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago, and nobody listens on it now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = discover(f"http://127.0.0.1:{port}", prefix=prefix)
    assert sorted(p.pid for p in found) == sorted(titled.values())
