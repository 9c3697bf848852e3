"""Native stacks of real GPU processes (tests/data/gpu, one H200): the host's device waits and NCCL frames."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from watchdog.core.processes import LOCAL, ProcessId
from watchdog.core.roles import Role
from watchdog.evidence.explain.classes import Cls
from watchdog.evidence.explain.ranks import classify
from watchdog.evidence.stacks.frames import Frame, ProcessStack, ThreadStack
from watchdog.evidence.stacks.parse import parse_pyspy_json

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"


def _classify(name: str) -> Cls:
    stack = parse_pyspy_json(json.loads((DATA / name).read_text()))
    return classify(stack, Role.WORKER, "R").cls


@pytest.mark.parametrize(("dump", "cls"), [
    ("spin-pyspy-native.json", Cls.DEVICE_WAIT),  # CuPy cudaDeviceSynchronize > cuCtxSynchronize_v2
    ("spin_wide-pyspy-native.json", Cls.DEVICE_WAIT),
    ("nccl-pyspy-native.json", Cls.DEVICE_WAIT),  # c10d barrier > cudaStreamSynchronize > cuStreamSynchronize
    ("nccl_bypass-pyspy-native.json", Cls.DEVICE_WAIT),
    ("nccl2-rank0-pyspy-native.json", Cls.DEVICE_WAIT),
    ("nccl-pyspy-plain.json", Cls.IN_COLLECTIVE),  # the Python stack sees only the barrier
])
def test_real_native_dumps(dump: str, cls: Cls) -> None:
    assert _classify(dump) == cls


def test_plain_stack_of_a_cupy_sync_is_not_recognised_native_is() -> None:
    # why native matters: the plain stack ends in the caller of a C function
    assert _classify("spin-pyspy-plain.json") == Cls.UNKNOWN
    assert _classify("spin-pyspy-native.json") == Cls.DEVICE_WAIT


def _native(*functions: str) -> ProcessStack:
    frames = tuple(Frame(f, "libnccl.so.2" if not f.startswith("cu") else "libcuda.so", None, native=True)
                   for f in functions)
    py = (Frame("all_reduce", "vllm/distributed/device_communicators/pynccl_wrapper.py", 1),)
    return ProcessStack(1, "VLLM::Worker_TP0", (ThreadStack("1", "MainThread", frames + py, True, None),),
                        "py-spy-native")


@pytest.mark.parametrize(("functions", "cls"), [
    (("cuLaunchKernelEx", "ncclLaunchKernel", "doLaunches", "groupLaunch", "ncclGroupEndInternal"),
     Cls.IN_COLLECTIVE),
    (("0x7f00", "ncclLocalOpAppend", "ncclProxyPost"), Cls.IN_COLLECTIVE),
    (("cuEventQuery", "c10d::ProcessGroupNCCL::WorkNCCL::isCompleted"), Cls.DEVICE_WAIT),
    (("cudaStreamQuery",), Cls.DEVICE_WAIT),
    (("nvshmemx_barrier_all_on_stream",), Cls.IN_COLLECTIVE),
    (("cuLaunchKernel",), Cls.IN_COLLECTIVE),  # nothing native decides: the Python frame (pynccl) does
])
def test_native_patterns(functions: tuple[str, ...], cls: Cls) -> None:
    assert classify(_native(*functions), Role.WORKER, "R").cls == cls


def test_a_stopped_process_is_never_passed_off_as_native_stacks(tmp_path: Path) -> None:
    """Seen on the H200 (a SIGSTOPped VLLM::EngineCore): the bundle's --native dump was the plain one again. The real
    py-spy cannot unwind a stopped process (blocking: 'Failed to suspend process'; --nonblocking refuses --native), so
    it is not asked: the native dump says why, the rounds keep its Python frames, a running process still gets its
    native frames."""
    import os
    import signal
    import subprocess
    import sys

    from watchdog.core.processes import EngineProcess, Failure
    from watchdog.evidence.collect.capture import STOPPED_NATIVE, Capturer, find_pyspy, run_argv

    pyspy = find_pyspy()
    assert pyspy is not None, "py-spy is one of the developers' packages (./scripts/setup)"
    argvs: list[list[str]] = []

    def runner(argv: object, timeout: float) -> tuple[int, str, str]:
        argvs.append(list(argv))  # type: ignore[call-overload]
        return run_argv(argv, timeout)  # type: ignore[arg-type]

    code = "import time\ndef parked():\n    while True:\n        time.sleep(0.2)\nparked()\n"
    kids = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(2)]
    stopped, running = kids
    try:
        for p in kids:  # each in its loop before it is stopped or dumped
            while "parked" not in subprocess.run([pyspy, "dump", "--pid", str(p.pid)], capture_output=True,
                                                 text=True, timeout=20, check=False).stdout:
                continue
        os.kill(stopped.pid, signal.SIGSTOP)
        for _ in range(50):
            if Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                break
            subprocess.run(["sleep", "0.1"], check=True, timeout=5)
        procs = [EngineProcess(p.pid, Role.ENGINE_CORE, f"VLLM::EngineCore_{i}") for i, p in enumerate(kids)]
        cap = Capturer(pyspy, timeout=20, runner=runner).capture(procs, rounds=2, gap=0.2,
                                                                 native_pids=frozenset(p.pid for p in kids))
    finally:
        for p in kids:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(10)
    assert all(r[ProcessId(LOCAL, stopped.pid)].ok and r[ProcessId(LOCAL, stopped.pid)].nonblocking for r in cap.rounds)
    assert "parked" in cap.rounds[-1][ProcessId(LOCAL, stopped.pid)].output
    native = cap.native[ProcessId(LOCAL, stopped.pid)]
    assert not native.ok and native.error == STOPPED_NATIVE and native.failure is Failure.NATIVE_UNREADABLE
    assert not [a for a in argvs if str(stopped.pid) in a and "--native" in a], argvs
    assert cap.native[ProcessId(LOCAL, running.pid)].ok
    assert [a for a in argvs if str(running.pid) in a and "--native" in a]
