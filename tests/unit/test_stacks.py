"""Stack-dump parsers on the real public corpus, on real py-spy output of a process started here, and on garbage."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from watchdog.evidence.stacks.parse import (
    SOURCES,
    Frame,
    ProcessStack,
    StackParseError,
    ThreadStack,
    parse_any,
    parse_pyspy_json,
    parse_text,
)

DUMPS = Path(__file__).resolve().parents[1] / "data" / "dumps"
PYSPY = Path(sys.executable).with_name("py-spy")
SECRET = "SECRET-PROMPT-never-keep-me"


def load(name: str) -> list[ProcessStack]:
    return parse_any((DUMPS / name).read_bytes())


def funcs(t: ThreadStack, n: int | None = None) -> list[str]:
    return [f.function for f in t.frames[:n]]


# ------------------------------------------------------------------------------------------ the corpus

# file -> per process: (pid, title, [thread names], source). Thread names "" are unnamed (faulthandler, excerpts).
CORPUS: dict[str, list[tuple[int | None, str, list[str], str]]] = {
    "sglang-11208-scheduler-forward-thread-nccl-window-register.txt": [
        (None, "", ["", "Thread-1 (_read_thread)", "Thread-2 (forward_thread_func)"], "py-spy-text")],
    "sglang-12076-scheduler-tp6-eagle-verify-penalty.txt": [
        (None, "", ["", "Thread-10 (watchdog_thread)"], "py-spy-text"),  # tail of TP3's dump
        (309, "sglang::scheduler_TP6", ["MainThread"], "py-spy-text")],
    "sglang-17941-scheduler-pp2-tp1-gloo-recv.txt": [
        (None, "", ["", "Thread-2 (_watchdog_thread)"], "py-spy-native"),  # tail of PP1's dump
        (88693, "sglang::scheduler_PP2_TP1", ["MainThread"], "py-spy-native")],
    "sglang-24588-scheduler-mainthread-quant-op-during-jit-deadlock.txt": [(None, "", ["MainThread"], "py-spy-text")],
    "sglang-31178-scheduler-tp6-threading-shutdown-native.txt": [
        (187, "sglang::scheduler_TP6", ["MainThread", "tqdm_monitor", "InductorSubproc", "tqdm_monitor"],
         "py-spy-native")],
    "sglang-4257-tp0-forward-thread-flashinfer-prefill.txt": [
        (2696393, "sglang::scheduler_None",
         ["MainThread", "Thread-1", "Thread-2", "Thread-3 (forward_thread_func)", "Thread-4 (watchdog_thread)"],
         "py-spy-text")],
    "sglang-5034-dp0-tp0-flashinfer-jit-filelock.txt": [
        (112694, "sglang::scheduler_DP0_TP0",
         ["MainThread", "Thread-1 (_read_thread)", "Thread-2", "Thread-3", "Thread-4 (forward_thread_func)",
          "Thread-5 (watchdog_thread)"], "py-spy-text")],
    "sglang-6891-scheduler-dp1-tp3-eagle-draft.txt": [
        (231810, "sglang::scheduler_DP1_TP3", ["MainThread", "Thread-1 (_read_thread)"], "py-spy-text")],
    "vllm-15687-ray-worker-ncclCommInitRank-faulthandler.txt": [(336, "RayWorkerWrapper", [""], "faulthandler")],
    "vllm-17676-enginecore-flashinfer-sampling-warmup.txt": [(2403, "VLLM::EngineCore", [""], "py-spy-text")],
    "vllm-18466-worker-v1-abort-in-acquire-read-faulthandler.txt": [(None, "", ["", ""], "faulthandler")],
    "vllm-2479-v0-ray-worker-all-gather.txt": [(None, "", ["MainThread"], "py-spy-text")],
    "vllm-50835-enginecore-ray-pp-dequeue-recv.txt": [(4085279, "VLLM::EngineCore", ["MainThread"], "py-spy-text")],
    "vllm-ascend-repo53773705266-worker-ep72-npu-sync-acl-graph-dummy-run.txt": [
        (None, "", ["MainThread"], "py-spy-text")],
    "vllm-lmcache-4759-enginecore-background-threads-idle.txt": [
        (None, "", ["", "MultiprocWorkerMonitor", "mq-client-shared-loop", "Thread-1 (process_input_sockets)",
                    "Thread-2 (process_output_sockets)", "signal-callback"], "py-spy-text")],
    "vllm-pr41834-worker-tp0-ep0-idle-shm-poll.txt": [(861049, "VLLM::Worker_TP0_EP0", ["MainThread"], "py-spy-text")],
    # A hand-condensed gdb backtrace ("a → b → c", "(py) f  file:line"): not a format we read; nothing comes out.
    "vllm-pr41834-worker-tp0-gdb-cuStreamSynchronize-item.txt": [],
    "vllm-repo54367556517-ray-worker-pynccl-init-ncclAllReduce.txt": [(None, "", ["MainThread"], "py-spy-text")],
    "vllm-repo55180035228-enginecore-response-mq-poll-locals.txt": [(None, "", ["MainThread"], "py-spy-text")],
    "vllm-repo55536668370-enginecore-idle-input-queue.txt": [(None, "", ["MainThread"], "py-spy-text")],
    "vllm-repo68901464014-enginecore-xpu-urEventWait-gdn-metadata.txt": [(None, "", ["MainThread"], "py-spy-native")],
    "vllm-v0-musa-repo71281069120-driver-rank0-broadcast-tensor-dict.txt": [(None, "", [""], "py-spy-text")],
    "gpu-pyspy-wedged.txt": [(552, "python3 -c", ["MainThread"], "py-spy-text")],
    "gpu-pyspy-native-wedged.txt": [(552, "python3 -c", ["MainThread"], "py-spy-native")],
}


def test_every_corpus_file_is_read() -> None:
    """The files above are checked in detail here; the ones added later in test_field_dumps.py. Every file gives a
    process except the hand-condensed gdb backtrace, which is no format we read."""
    names = {p.name for p in DUMPS.glob("*.txt")}
    assert set(CORPUS) <= names
    assert [n for n in sorted(names) if not load(n)] == ["vllm-pr41834-worker-tp0-gdb-cuStreamSynchronize-item.txt"]


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_processes_threads_and_sources(name: str) -> None:
    got = [(p.pid, p.title.splitlines()[0].strip() if p.title else "", [t.name for t in p.threads], p.source)
           for p in load(name)]
    assert got == CORPUS[name]


def test_frames_are_innermost_first_in_every_format() -> None:
    (text,) = [p for p in load("vllm-pr41834-worker-tp0-ep0-idle-shm-poll.txt")]
    assert funcs(text.threads[0]) == ["poll", "wait", "acquire_read", "dequeue", "worker_busy_loop", "worker_main"]
    assert text.threads[0].frames[1] == Frame("wait", "vllm/distributed/device_communicators/shm_broadcast.py", 198)
    # faulthandler prints the most recent call first too; the tqdm thread comes first in the file
    (fh,) = load("vllm-18466-worker-v1-abort-in-acquire-read-faulthandler.txt")
    assert funcs(fh.threads[1], 4) == ["acquire_read", "__enter__", "dequeue", "worker_busy_loop"]
    assert fh.threads[1].thread_id == "0x00007f581410d000"
    assert fh.threads[1].frames[0].line == 425
    # the last line is another process's stderr spliced into a frame: dropped, not misread
    assert fh.threads[1].frames[-1].function == "run_engine_core"


def test_native_frames_are_flagged_and_keep_their_library() -> None:
    (_, sched) = load("sglang-17941-scheduler-pp2-tp1-gloo-recv.txt")
    frames = sched.threads[0].frames
    assert [f.native for f in frames] == [True] * 4
    assert frames[2] == Frame("gloo::transport::tcp::UnboundBuffer::waitRecv", "libtorch_cpu.so", None, native=True)
    (gpu,) = load("gpu-pyspy-native-wedged.txt")
    python = [f for f in gpu.threads[0].frames if not f.native]
    assert [f.function for f in python] == ["wait_for_device", "<module>"]
    assert Frame("runtime_deviceSynchronize", "runtime.cpp", 11172, native=True) in gpu.threads[0].frames


def test_multi_line_process_title_is_kept_whole() -> None:
    (gpu,) = load("gpu-pyspy-wedged.txt")
    assert gpu.title.startswith("python3 -c \nimport cupy as cp")
    assert gpu.title.rstrip().endswith("wait_for_device()")
    assert funcs(gpu.threads[0]) == ["wait_for_device", "<module>"]


def test_log_prefixes_are_stripped_and_ray_prefix_gives_the_pid() -> None:
    (_, tp6) = load("sglang-12076-scheduler-tp6-eagle-verify-penalty.txt")
    # the blank "sglang-1  | " line inside the excerpt does not split MainThread
    assert funcs(tp6.threads[0]) == ["_apply", "apply", "apply", "apply_logits_bias", "verify", "verify",
                                     "forward_batch_generation"]
    assert tp6.threads[0].active is True
    (ray,) = load("vllm-15687-ray-worker-ncclCommInitRank-faulthandler.txt")
    assert ray.pid == 336
    assert funcs(ray.threads[0], 2) == ["ncclCommInitRank", "__init__"]
    assert len(ray.threads[0].frames) == 17


def test_locals_are_never_kept_from_text_dumps() -> None:
    (ps,) = load("vllm-repo55180035228-enginecore-response-mq-poll-locals.txt")
    assert funcs(ps.threads[0]) == ["poll", "wait", "acquire_read", "dequeue"]
    assert "60000" not in repr(ps)
    text = ('Thread 7 (idle): "MainThread"\n    f (a.py:1)\n        Arguments:\n            prompt: "hi (x.py:2)"\n'
            '        Locals:\n            key: "sk-123"\n    g (a.py:2)\n')
    (ps,) = parse_text(text)
    assert funcs(ps.threads[0]) == ["f", "g"]
    assert "sk-123" not in repr(ps) and "hi" not in repr(ps)


def test_transcribed_and_elided_dumps() -> None:
    (w,) = load("vllm-pr41834-worker-tp0-ep0-idle-shm-poll.txt")
    assert (w.title, w.threads[0].thread_id, w.threads[0].active) == ("VLLM::Worker_TP0_EP0", "", False)
    (r,) = load("vllm-repo54367556517-ray-worker-pynccl-init-ncclAllReduce.txt")
    assert funcs(r.threads[0])[-2:] == ["init_worker_distributed_environment", "init_device"]  # across "..."
    (a,) = load("vllm-ascend-repo53773705266-worker-ep72-npu-sync-acl-graph-dummy-run.txt")
    assert a.threads[0].frames[0] == Frame("synchronize", "torch_npu/npu/streams.py", 85)  # "← 卡在这里" dropped
    (v0,) = load("vllm-v0-musa-repo71281069120-driver-rank0-broadcast-tensor-dict.txt")
    assert funcs(v0.threads[0])[0] == "broadcast" and len(v0.threads[0].frames) == 11


def test_python_314_thread_without_name_and_gil_state() -> None:
    (ps,) = load("vllm-17676-enginecore-flashinfer-sampling-warmup.txt")
    t = ps.threads[0]
    assert (t.thread_id, t.name, t.active, t.gil) == ("2403", "", True, False)
    (ps,) = parse_text('Process 5: x\nPython v3.12.1 (/usr/bin/python3)\n\nThread 5 (active+gil): "MainThread"\n'
                       "    f (a.py:3)\n")
    assert (ps.threads[0].active, ps.threads[0].gil) == (True, True)


def test_several_processes_with_subprocess_separators() -> None:
    text = ("Process 10: python parent.py\nPython v3.11.7 (/usr/bin/python3.11)\n\nThread 10 (idle): \"MainThread\"\n"
            "    <module> (parent.py:3)\n\n" + "-" * 80 + "\nProcess 12: python -c import time\ndef child():\n"
            "    time.sleep(600)\nchild()\nPython v3.11.7 (/usr/bin/python3.11)\n"
            "Parent Process 10: python parent.py\n\nThread 12 (idle)\n    child (<string>:3)\n"
            "    <module> (<string>:4)\n")
    parent, child = parse_text(text)
    assert (parent.pid, child.pid) == (10, 12)
    assert child.title.splitlines()[-1] == "child()"
    assert funcs(child.threads[0]) == ["child", "<module>"] and child.threads[0].name == ""


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("junk", [
    "", "\n\n", "hello world", "Process x: y", "Thread", "(((((((", "\x00\x01\x02", "File \"x\", line",
    "ValueError: boom\n    raise ValueError\n", "#include <stdio.h>\n#define X 1", "[<0>]",
    "func+0x1/0x2 is not a frame",
    "a (b) c (d)\n" * 50, "x" * 100_000, "[2025-01-01 00:00:00] INFO started (pid=1)\n",
])
def test_garbage_gives_no_process(junk: str) -> None:
    assert parse_text(junk) == []
    assert parse_any(junk.encode()) == []


def test_json_shapes_are_checked() -> None:
    shapes: tuple[object, ...] = ({"threads": []}, [1], [{"frames": "x"}], [{"frames": [{"name": 1}]}], "x", None)
    for bad in shapes:
        with pytest.raises(StackParseError):
            parse_pyspy_json(bad)
    with pytest.raises(StackParseError):
        parse_any(b'{"not": "a dump"}')
    with pytest.raises(StackParseError):
        parse_text(b"bytes")  # type: ignore[arg-type]
    assert parse_any(b"[]") == []
    assert parse_any(b"[not json") == []  # falls back to text, finds nothing


def test_mutated_corpus_never_crashes() -> None:
    rng = random.Random(1234)
    texts = [p.read_text(encoding="utf-8") for p in sorted(DUMPS.glob("*.txt"))]
    for _ in range(300):
        lines = rng.choice(texts).splitlines()
        op = rng.randrange(4)
        if op == 0:
            lines = lines[rng.randrange(len(lines) + 1):]
        elif op == 1:
            rng.shuffle(lines)
        elif op == 2:
            lines = [line[: rng.randrange(len(line) + 1)] for line in lines]
        else:
            lines = [line.replace(rng.choice("():\" "), rng.choice(["", "((", "\t", "\""])) for line in lines]
        for ps in parse_any("\n".join(lines).encode("utf-8", errors="replace")):
            assert ps.source in SOURCES


# ------------------------------------------------------------------------------------------ real py-spy output

# A miniature of a vLLM worker: the same files, classes and call chain as vLLM 0.32's idle worker, waiting in
# select.poll as SpinCondition.wait does, plus a helper thread and a local holding a "prompt".
MIMIC = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/device_communicators/__init__.py": "",
    "vllm/distributed/device_communicators/shm_broadcast.py": (
        "import contextlib, os, select\n\n"
        "class SpinCondition:\n"
        "    def wait(self, timeout_ms):\n"
        "        self.r, self.w = os.pipe()\n"
        "        poller = select.poll()\n"
        "        poller.register(self.r, select.POLLIN)\n"
        "        while True:\n"
        "            poller.poll(timeout_ms)\n\n"
        "class MessageQueue:\n"
        "    def __init__(self):\n"
        "        self.cond = SpinCondition()\n\n"
        "    @contextlib.contextmanager\n"
        "    def acquire_read(self):\n"
        "        self.cond.wait(60000)\n"
        "        yield\n\n"
        "    def dequeue(self):\n"
        "        with self.acquire_read():\n"
        "            return None\n"
    ),
    "vllm/v1/__init__.py": "",
    "vllm/v1/executor/__init__.py": "",
    "vllm/v1/executor/multiproc_executor.py": (
        "import queue, sys, threading\n"
        "from vllm.distributed.device_communicators.shm_broadcast import MessageQueue\n\n"
        "class WorkerProc:\n"
        "    def worker_busy_loop(self):\n"
        f"        prompt = {SECRET!r}\n"
        "        mq = MessageQueue()\n"
        "        print('ready', flush=True)\n"
        "        while True:\n"
        "            mq.dequeue()\n\n"
        "    @staticmethod\n"
        "    def worker_main():\n"
        "        q = queue.Queue()\n"
        "        threading.Thread(target=q.get, name='DeathPipeMonitor', daemon=True).start()\n"
        "        WorkerProc().worker_busy_loop()\n"
    ),
    "main.py": "from vllm.v1.executor.multiproc_executor import WorkerProc\nWorkerProc.worker_main()\n",
}


@contextmanager
def mimic_worker(root: Path) -> Iterator[int]:
    for rel, body in MIMIC.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    proc = subprocess.Popen([sys.executable, str(root / "main.py")], cwd=root, stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        yield proc.pid
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def pyspy(pid: int, *args: str) -> str:
    cmd = [str(PYSPY), "dump", "--pid", str(pid), *args]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    # py-spy is a dependency and the tests run as root: failing to attach is a failure, not a skip
    assert out.returncode == 0, f"py-spy cannot attach here: {out.stderr.strip()[:200]}"
    return out.stdout


def check_mimic(ps: ProcessStack) -> None:
    main = next(t for t in ps.threads if t.name == "MainThread")
    names = [f.function.rsplit(".", 1)[-1] for f in main.frames if not f.native]
    assert names[:6] == ["wait", "acquire_read", "__enter__", "dequeue", "worker_busy_loop", "worker_main"]
    first_python = next(f for f in main.frames if not f.native)
    assert first_python.file.endswith("vllm/distributed/device_communicators/shm_broadcast.py")
    assert {t.name for t in ps.threads} == {"MainThread", "DeathPipeMonitor"}
    assert SECRET not in repr(ps)


def test_stored_real_pyspy_json_dump() -> None:
    """Captured here with `py-spy dump --json --locals` (py-spy 0.4.3, Python 3.11) from the MIMIC worker."""
    raw = (DUMPS / "pyspy-real-mimic-worker-locals.json").read_text()
    assert SECRET in raw  # the capture did hold the local ...
    data = json.loads(raw)
    ps = parse_pyspy_json(data, title="VLLM::Worker_TP0")
    check_mimic(ps)  # ... and the parsed stack does not
    assert ps.source == "py-spy-json" and ps.pid == data[0]["pid"] and ps.title == "VLLM::Worker_TP0"
    main = next(t for t in ps.threads if t.name == "MainThread")
    assert main.frames[0].function == "SpinCondition.wait"  # py-spy 0.4 qualifies names on Python 3.11+
    assert main.thread_id == str(ps.pid) and main.active is False and main.gil is False
    assert [p.pid for p in parse_any(raw.encode())] == [ps.pid]


def test_live_pyspy_json_text_and_native_agree(tmp_path: Path) -> None:
    with mimic_worker(tmp_path) as pid:
        as_json = parse_pyspy_json(json.loads(pyspy(pid, "--json", "--locals")), pid=pid)
        (as_text,) = parse_text(pyspy(pid, "--locals"))
        (native,) = parse_text(pyspy(pid, "--native"))
    for ps in (as_json, as_text, native):
        check_mimic(ps)
    assert as_text.pid == pid and as_text.source == "py-spy-text" and native.source == "py-spy-native"
    main_json = next(t for t in as_json.threads if t.name == "MainThread")
    main_text = next(t for t in as_text.threads if t.name == "MainThread")
    assert funcs(main_json) == funcs(main_text)
    assert [f.line for f in main_json.frames] == [f.line for f in main_text.frames]
