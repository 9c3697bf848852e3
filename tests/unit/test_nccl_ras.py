"""NCCL RAS: the parser on real answers from H200s (tests/data/gpu), the query against local sockets."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.facts import says
from watchdog.evidence.gpu.nccl_ras import REQUEST, query_ras
from watchdog.evidence.gpu.ras_status import parse_ras

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"


def test_real_two_rank_mismatch() -> None:
    st = parse_ras((DATA / "nccl2-ras-stalled.txt").read_text())
    assert (st.nccl_version, st.cuda, st.nodes, st.processes, st.gpus) == ("2.28.9", "13.0", 1, 2, 2)
    [comm] = st.communicators
    assert (comm.group, comm.status, comm.errors, comm.ranks) == (0, "RUNNING", "MISMATCH", 2)
    [block] = st.blocks
    assert block.kind == "MISMATCH" and block.launched == {0: 6, 1: 5} and block.behind() == [1]
    assert not st.healthy
    assert "rank 1 at 5" in st.verdict() and "operation 6" in st.verdict()


@pytest.mark.parametrize("name", ["nccl-ras-healthy.txt", "nccl-ras-stalled.txt", "nccl_bypass-ras-healthy.txt"])
def test_real_one_rank_answers_are_healthy(name: str) -> None:
    st = parse_ras((DATA / name).read_text())
    assert st.healthy and st.processes == 1 and st.communicators[0].errors == "OK"
    assert "all ranks present" in st.verdict()


def test_missing_ranks_and_garbage() -> None:
    # constructed from the real answer: its MISMATCH block turned into a missing-rank one
    text = (DATA / "nccl2-ras-stalled.txt").read_text().replace("MISMATCH", "INCOMPLETE").replace(
        "Communicator ranks have different AllReduce operation counts", "Rank 1 is not responding")
    st = parse_ras(text)
    assert st.missing_ranks == ("Rank 1 is not responding",)
    assert says(st.verdict(), "RAS", "missing", "Rank 1"), st.verdict()
    empty = parse_ras("")
    assert not empty.healthy and empty.problems and "no communicator" in empty.verdict()
    assert parse_ras("\x00\xff garbage\nCommunicators\n=====\nnot a row\n").communicators == ()


@pytest.fixture
def server() -> Iterator[Callable[[Callable[[socket.socket], None]], int]]:
    socks: list[socket.socket] = []

    def start(handle: Callable[[socket.socket], None]) -> int:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        socks.append(srv)

        def run() -> None:
            conn, _ = srv.accept()
            socks.append(conn)
            handle(conn)
        threading.Thread(target=run, daemon=True).start()
        return int(srv.getsockname()[1])
    yield start
    for s in socks:
        s.close()


def test_query_reads_until_close(server: Callable[[Callable[[socket.socket], None]], int]) -> None:
    got: list[bytes] = []

    def answer(conn: socket.socket) -> None:
        got.append(conn.recv(100))
        conn.sendall((DATA / "nccl2-ras-stalled.txt").read_bytes())
        conn.close()
    a = query_ras(port=server(answer), timeout=5)
    assert a.ok and not a.error and got == [REQUEST]
    assert parse_ras(a.text).blocks[0].launched == {0: 6, 1: 5}


def test_silent_ras_is_recorded_within_the_deadline(server: Callable[[Callable[[socket.socket], None]], int]) -> None:
    hold = threading.Event()
    a = query_ras(port=server(lambda conn: hold.wait(5)), timeout=0.3)
    hold.set()
    assert not a.ok and "did not" in a.error and a.seconds < 2


def test_trickling_ras_is_cut_at_the_deadline(server: Callable[[Callable[[socket.socket], None]], int]) -> None:
    stop = threading.Event()

    def trickle(conn: socket.socket) -> None:
        while not stop.wait(0.05):
            conn.sendall(b"x")
    a = query_ras(port=server(trickle), timeout=0.5)
    stop.set()
    assert not a.ok and "did not finish" in a.error and a.text.startswith("x") and a.seconds < 2


def test_byte_cap(server: Callable[[Callable[[socket.socket], None]], int]) -> None:
    a = query_ras(port=server(lambda conn: conn.sendall(b"y" * 100_000)), timeout=5, max_bytes=1000)
    assert a.truncated and len(a.text) == 1000


def test_nothing_listening() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    a = query_ras(port=port, timeout=1)
    assert not a.ok and "nothing listens" in a.error
