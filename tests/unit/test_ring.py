"""The broadcast ring as evidence: the layout per version, the flags parsed, the sentence, and the reading of real
segments in /dev/shm that real processes map (an EngineCore and its workers, as their /proc/PID/maps show them),
with the exact byte layout vLLM's ShmRingBuffer has (docs/ring.md). Nothing is mocked: the processes, the maps,
the files and the refusals are the kernel's."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdog.core.processes import EngineProcess
from watchdog.core.ring import Ring, RingBlock
from watchdog.core.roles import Role
from watchdog.evidence.collect.ring import NOT_FOUND, read_rings
from watchdog.evidence.explain.ring_layout import MIB, Layout, layout_for, parse_metadata, ring_of
from watchdog.evidence.explain.ring_said import ring_to_dict, said, said_all
from watchdog.nodes.protocol import ProtocolError, ring_from_json

REPO = Path(__file__).resolve().parents[2]
READ = ("0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")


def broadcast_size(n: int, chunk_mib: int = 16) -> int:
    return (chunk_mib * MIB + 1 + n) * 10


# ---------------------------------------------------------------- the layout, pure


@pytest.mark.parametrize("version", [*READ, "0.25.1+cpu", "0.32.0.dev3+g1234"])
def test_every_version_read_has_the_one_layout(version: str) -> None:
    lay = layout_for(broadcast_size(2), 2, version)
    assert isinstance(lay, Layout), lay
    assert (lay.name, lay.max_chunks, lay.max_chunk_bytes, lay.n_reader) == ("vllm 0.25-0.32", 10, 16 * MIB, 2)
    assert lay.metadata_offset == 160 * MIB and lay.metadata_size == 30 and lay.total == broadcast_size(2)


@pytest.mark.parametrize("version", ["0.24.0", "0.33.0", "0.20.2", "1.0.0", "nightly"])
def test_an_unknown_version_is_refused_not_guessed(version: str) -> None:
    assert layout_for(broadcast_size(2), 2, version) == \
        f"layout of vLLM {version} not known (read: 0.25.x to 0.32.x)"


def test_no_version_is_refused() -> None:
    assert "version is not known" in str(layout_for(broadcast_size(2), 2, ""))


@pytest.mark.parametrize(("size", "n"), [(broadcast_size(2), 3), (broadcast_size(2) + 1, 2), (12345, 1), (0, 1),
                                          (broadcast_size(2) - 10 * MIB // 2, 2)])
def test_a_size_that_fits_no_layout_is_refused(size: int, n: int) -> None:
    why = layout_for(size, n, "0.25.1")
    assert isinstance(why, str) and why.startswith(f"size {size} does not match the vllm 0.25-0.32 layout with {n}")


def test_other_chunk_sizes_fit_and_the_response_ring_has_its_shape() -> None:
    lay = layout_for(broadcast_size(4, 64), 4, "0.30.0")  # VLLM_MQ_MAX_CHUNK_BYTES_MB=64
    assert isinstance(lay, Layout) and lay.max_chunk_bytes == 64 * MIB and not lay.response_shaped
    resp = layout_for((24 * MIB + 2) * 10, 1, "0.32.0")  # MessageQueue(1, 1)
    assert isinstance(resp, Layout) and resp.response_shaped
    assert "0 local readers" in str(layout_for(broadcast_size(0), 0, "0.32.0"))


def test_metadata_parsed_truncated_and_not_flags() -> None:
    lay = Layout("vllm 0.25-0.32", 10, 16 * MIB, 2)
    data = bytes([1, 1, 1] * 4 + [1, 0, 1] + [0, 0, 0] * 5)
    blocks = parse_metadata(data, lay)
    assert isinstance(blocks, tuple) and len(blocks) == 10
    assert blocks[4] == RingBlock(4, True, (False, True)) and blocks[4].unread_by() == (0,)
    assert blocks[9] == RingBlock(9, False, (False, False)) and blocks[9].unread_by() == ()
    assert parse_metadata(data[:17], lay) == "truncated read: 17 of 30 metadata bytes"
    assert "flag byte 2 of block 1 is 7, not 0 or 1" in str(parse_metadata(data[:5] + b"\x07" + data[6:], lay))
    bad = ring_of("psm_x", lay, b"")
    assert bad.error == "truncated read: 0 of 30 metadata bytes" and not bad.blocks


# ---------------------------------------------------------------- the sentence, pure


def _ring(rows: list[tuple[int, ...]], readers: tuple[str, ...] = ("Worker_TP0", "Worker_TP1")) -> Ring:
    lay = Layout("vllm 0.25-0.32", len(rows), 16 * MIB, len(rows[0]) - 1)
    return ring_of("psm_ab12", lay, bytes(b for r in rows for b in r), readers=readers, writer="EngineCore_DP0",
                   version="0.25.1")


def test_the_sentence() -> None:
    rows = [(1, 1, 1)] * 4 + [(1, 0, 1)] + [(0, 0, 0)] * 5
    assert said(_ring(rows)) == ("ring psm_ab12 (vllm 0.25-0.32 layout, 10 blocks, 2 local readers): block 4 written, "
                                 "read by Worker_TP1, not by Worker_TP0")
    assert said(_ring([(1, 1, 1)] * 10)) == ("ring psm_ab12 (vllm 0.25-0.32 layout, 10 blocks, 2 local readers): "
                                             "every written block read by every reader (10 written)")
    assert said(_ring([(0, 0, 0)] * 10)).endswith(": no block written yet")
    none = said(_ring([(1, 0, 0)] + [(0, 0, 0)] * 9, ("", "")))
    assert none.endswith("block 0 written, read by none of its 2 local readers (local reader 0, local reader 1)")
    many = said(_ring([(1, 0, 1)] * 10))
    assert many.count("written, read by") == 4 and many.endswith("6 more blocks written and not read by all")
    assert said(Ring("psm_ab12", error="size 3 does not match")) == "ring psm_ab12: size 3 does not match"
    assert said(Ring("", "n2", error="ring not read: refused")) == "node n2: ring not read: refused"
    assert said(Ring("", error=NOT_FOUND)) == NOT_FOUND
    assert said_all([]).startswith("not read")


def test_the_agents_answer_round_trips_and_is_checked() -> None:
    ring = _ring([(1, 1, 1)] * 4 + [(1, 0, 1)] + [(0, 0, 0)] * 5)
    d = ring_to_dict(ring)
    assert d["blocks"][4] == {"index": 4, "written": True, "read": [False, True], "unread_by": ["Worker_TP0"]}
    back = ring_from_json(d, "n2")
    assert back.node == "n2" and back.blocks == ring.blocks and back.readers == ring.readers
    assert said(back).startswith("ring psm_ab12 on node n2 (vllm 0.25-0.32 layout")
    d["blocks"][0]["read"] = [True]
    with pytest.raises(ProtocolError, match="one read flag per reader"):
        ring_from_json(d, "n2")
    with pytest.raises(ProtocolError, match="not an object"):
        ring_from_json([], "n2")


# ---------------------------------------------------------------- real segments, real processes

class Peers:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.paths: list[str] = []

    def segment(self) -> str:
        path = f"/dev/shm/psm_wdtest_{secrets.token_hex(4)}"  # where SharedMemory puts them
        self.paths.append(path)
        return path

    def close(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.close()
            p.wait(10)
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)


MULTI = r"""
import mmap, os, sys
maps = []
for spec in sys.argv[1:]:
    path, size, flags = spec.split(",")
    size, flags = int(size), bytes.fromhex(flags)
    if size:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        if flags:
            os.pwrite(fd, flags, size - len(flags))
    else:
        fd = os.open(path, os.O_RDWR)
    maps.append(mmap.mmap(fd, 0))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def peers() -> Iterator[Peers]:
    p = Peers()
    yield p
    p.close()


def run_peer(peers: Peers, *specs: tuple[str, int, bytes]) -> int:
    """One process mapping every (path, size to create or 0 to attach, flags written at the end)."""
    argv = [sys.executable, "-c", MULTI, *(f"{path},{size},{flags.hex()}" for path, size, flags in specs)]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    peers.procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p.pid


def engine(peers: Peers, flags: bytes, n: int = 2, chunk_mib: int = 16) -> tuple[list[EngineProcess], str]:
    """An EngineCore with ``n`` workers as vLLM has them: the broadcast ring (EngineCore and every worker) and one
    response ring per worker (EngineCore and that worker), each its own psm_ segment."""
    ring = peers.segment()
    responses = [peers.segment() for _ in range(n)]
    size = broadcast_size(n, chunk_mib)
    fd = os.open(ring, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # as EngineCore's SharedMemory(create=True)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, flags, size - len(flags))
    finally:
        os.close(fd)
    # each worker attaches to the broadcast ring and creates its response ring; EngineCore maps them all
    workers = [run_peer(peers, (ring, 0, b""), (responses[i], (24 * MIB + 2) * 10, bytes([1, 1] * 10)))
               for i in range(n)]
    core = run_peer(peers, (ring, 0, b""), *((r, 0, b"") for r in responses))
    procs = [EngineProcess(core, Role.ENGINE_CORE, "VLLM::EngineCore_DP0", {"DP": 0})]
    # listed out of rank order: the reader order comes from the ranks, not the list
    for i in reversed(range(n)):
        procs.append(EngineProcess(workers[i], Role.WORKER, f"VLLM::Worker_TP{i}", {"TP": i}))
    return procs, os.path.basename(ring)


def test_the_broadcast_ring_of_real_processes(peers: Peers) -> None:
    flags = bytes([1, 1, 1] * 4 + [1, 0, 1] + [0, 0, 0] * 5)
    procs, name = engine(peers, flags)
    (ring,) = read_rings(procs, "0.25.1", t=5.0)
    assert ring.ok, ring.error
    assert (ring.segment, ring.writer, ring.readers, ring.max_chunks, ring.max_chunk_bytes, ring.t) == \
        (name, "EngineCore_DP0", ("Worker_TP0", "Worker_TP1"), 10, 16 * MIB, 5.0)
    assert [b.index for b in ring.unread()] == [4] and ring.unread()[0].unread_by() == (0,)
    assert said(ring) == (f"ring {name} (vllm 0.25-0.32 layout, 10 blocks, 2 local readers): block 4 written, "
                          "read by Worker_TP1, not by Worker_TP0")


def test_the_response_rings_are_not_taken_for_it_with_one_worker(peers: Peers) -> None:
    procs, name = engine(peers, bytes([1, 1] * 10), n=1)
    (ring,) = read_rings(procs, "0.32.0")
    assert ring.ok and ring.segment == name and said(ring).endswith("every written block read by every reader "
                                                                    "(10 written)")


def test_unknown_version_and_no_ring(peers: Peers) -> None:
    procs, _ = engine(peers, bytes(30))
    (ring,) = read_rings(procs, "0.33.1")
    assert ring.error == "layout of vLLM 0.33.1 not known (read: 0.25.x to 0.32.x)" and not ring.blocks
    lone = [procs[0], EngineProcess(run_peer(peers, (peers.segment(), 4096, b"")), Role.WORKER, "VLLM::Worker_TP0",
                                    {"TP": 0})]
    (none,) = read_rings(lone, "0.25.1")
    assert none.error == NOT_FOUND
    assert read_rings([procs[0]], "0.25.1") == ()  # no worker process: the one-process executor, no ring


def test_a_size_that_fits_nothing_is_said(peers: Peers) -> None:
    procs, _ = engine(peers, bytes(30), chunk_mib=16)
    wrong = procs[:2]  # one of the two workers not in the capture: 2 readers' ring seen with 1 mapper
    (ring,) = read_rings(wrong, "0.25.1")
    assert ring.error.startswith(NOT_FOUND), ring.error


def test_a_process_gone_is_said() -> None:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                       timeout=30, check=True)
    gone = int(p.stdout)
    procs = [EngineProcess(gone, Role.ENGINE_CORE, "VLLM::EngineCore_DP0"),
             EngineProcess(gone + 1 << 21, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})]
    (ring,) = read_rings(procs, "0.25.1")
    assert ring.error == f"maps of EngineCore_DP0 (pid {gone}) not readable: gone"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to read as another user")
def test_a_denied_read_is_said(peers: Peers) -> None:
    procs, _ = engine(peers, bytes(30))
    # imported as root, then read as nobody: /proc/PID/maps of another user's process is the kernel's refusal
    code = "\n".join([
        "import os",
        "from watchdog.core.processes import EngineProcess as P",
        "from watchdog.core.roles import Role",
        "from watchdog.evidence.collect.ring import read_rings",
        "from watchdog.evidence.explain.ring_said import said",
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)",
        f"core, worker = P({procs[0].pid}, Role.ENGINE_CORE, 'VLLM::EngineCore_DP0'), "
        f"P({procs[1].pid}, Role.WORKER, 'VLLM::Worker_TP1', {{'TP': 1}})",
        "print(said(read_rings([core, worker], '0.25.1')[0]))"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"maps of EngineCore_DP0 (pid {procs[0].pid}) not readable: denied (Permission denied)"
