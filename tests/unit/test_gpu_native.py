"""Native stacks of real GPU processes (tests/data/gpu, one H200): the host's device waits and NCCL frames."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from watchdog.core.roles import Role
from watchdog.evidence.explain.ranks import Cls, classify
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
