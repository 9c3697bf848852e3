"""The ring read from vLLM's own code: a real ``MessageQueue`` (EngineCore's broadcast ring, two local readers)
made by the engine venv's vLLM in three processes; the writer enqueues one step, reader 1 takes it, reader 0 does
not; the watchdog reads the version from the writer's own site-packages and the flags from /dev/shm, and says so.
Needs the engine venv (scripts/setup-engine); no server is started."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.engine_env import engine_python
from watchdog.core.processes import EngineProcess
from watchdog.core.roles import Role
from watchdog.evidence.collect.ring import read_engine_rings
from watchdog.evidence.explain.ring_said import said

pytestmark = pytest.mark.engine

WRITER = r"""
import base64, pickle, sys
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
mq = MessageQueue(2, 2, max_chunk_bytes=16 * 1024 * 1024)  # as MultiprocExecutor makes it, TP=2 on one node
print(base64.b64encode(pickle.dumps(mq.export_handle())).decode(), flush=True)
sys.stdin.readline()
mq.enqueue(("execute_model", (), {}, 0))
print("written", flush=True)
sys.stdin.read()
"""
READER = r"""
import base64, pickle, sys
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
mq = MessageQueue.create_from_handle(pickle.loads(base64.b64decode(sys.argv[1])), int(sys.argv[2]))
print("attached", flush=True)
if sys.stdin.readline().strip() == "read":
    print("read", mq.dequeue(timeout=60)[0], flush=True)
sys.stdin.read()
"""


def venv_python(version: str) -> Path:
    """That release's engine venv, installed first (scripts/setup-engine) where it is missing: never skipped."""
    return engine_python(version=version)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.stdin:
            p.stdin.close()
    for p in started:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    return p.stdout.readline().strip()


def say(p: subprocess.Popen[str], text: str) -> None:
    assert p.stdin is not None
    p.stdin.write(text + "\n")
    p.stdin.flush()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("version", ["0.32.0", "0.25.1"])
def test_a_written_block_one_reader_took(version: str, procs: list[subprocess.Popen[str]]) -> None:
    python = str(venv_python(version))
    env = {"PATH": "/usr/bin:/bin", "VLLM_TARGET_DEVICE": "cpu", "HOME": str(Path.home())}

    def start(code: str, *argv: str) -> subprocess.Popen[str]:
        p = subprocess.Popen([python, "-c", code, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
        procs.append(p)
        return p

    writer = start(WRITER)
    handle = line(writer)
    assert handle, "the writer made no MessageQueue"
    readers = [start(READER, handle, str(rank)) for rank in (0, 1)]
    assert [line(r) for r in readers] == ["attached", "attached"]
    say(writer, "go")
    assert line(writer) == "written"
    say(readers[1], "read")
    say(readers[0], "wait")
    assert line(readers[1]) == "read execute_model"
    engine = [EngineProcess(writer.pid, Role.ENGINE_CORE, "VLLM::EngineCore_DP0"),
              EngineProcess(readers[1].pid, Role.WORKER, "VLLM::Worker_TP1", {"TP": 1}),
              EngineProcess(readers[0].pid, Role.WORKER, "VLLM::Worker_TP0", {"TP": 0})]
    (ring,) = read_engine_rings(engine)
    assert ring.ok, ring.error
    assert ring.version == version and ring.max_chunk_bytes == 16 << 20 and len(ring.blocks) == 10
    assert said(ring) == (f"ring {ring.segment} (vllm 0.25-0.32 layout, 10 blocks, 2 local readers): block 0 "
                          "written, read by Worker_TP1, not by Worker_TP0")
