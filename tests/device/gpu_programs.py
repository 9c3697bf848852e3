"""Small real GPU programs for the watchdog's device runs (see tests/device/README.md). Each ends itself.

    python3 tests/device/gpu_programs.py SCENARIO --dir DIR [--seconds N]

Scenarios: idle, matmul, gemv, spin, spin_wide, nccl (torch.distributed, one rank, Flight Recorder on),
nccl_bypass (NCCL called directly through ctypes, as vLLM's PyNccl does; the Flight Recorder cannot see it).
The program writes DIR/ready once the state to observe is reached, and ends when DIR/release appears, when
--seconds have passed, or (spin kernels) when the kernel's own deadline passes.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import threading
import time
from pathlib import Path

import cupy as cp
import numpy as np

SPIN_SRC = r"""
extern "C" __global__ void spin(volatile int *flag, unsigned long long max_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (flag[0] == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > max_ns) break;
    }
}
"""


class Flag:
    """An int in pinned host memory that a kernel polls; set from a watcher thread when DIR/release appears."""

    def __init__(self, d: Path, seconds: float) -> None:
        self.mem = cp.cuda.alloc_pinned_memory(4)
        self.host = np.frombuffer(self.mem, np.int32, 1)
        self.host[0] = 0
        self.dev = self.mem.ptr  # pinned memory under unified addressing: the device uses the host pointer
        self.max_ns = int(seconds * 1e9)
        threading.Thread(target=self._watch, args=(d, seconds), daemon=True).start()

    def _watch(self, d: Path, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not (d / "release").exists() and time.monotonic() < end:
            time.sleep(0.05)
        self.host[0] = 1

    def launch(self, blocks: int, threads: int, stream: cp.cuda.Stream | None = None) -> None:
        kernel = cp.RawKernel(SPIN_SRC, "spin")
        if stream is None:
            kernel((blocks,), (threads,), (np.uint64(self.dev), np.uint64(self.max_ns)))
        else:
            with stream:
                kernel((blocks,), (threads,), (np.uint64(self.dev), np.uint64(self.max_ns)))


def ready(d: Path, **info: object) -> None:
    (d / "ready.tmp").write_text(repr(info))
    os.replace(d / "ready.tmp", d / "ready")


def wait_release(d: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not (d / "release").exists() and time.monotonic() < end:
        time.sleep(0.05)


def idle(d: Path, seconds: float) -> None:
    x = cp.zeros(1 << 20, dtype=cp.float32)  # holds a context and some memory, runs nothing
    cp.cuda.Device().synchronize()
    ready(d, bytes=x.nbytes)
    wait_release(d, seconds)


def matmul(d: Path, seconds: float) -> None:
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ready(d)
    end = time.monotonic() + seconds
    while not (d / "release").exists() and time.monotonic() < end:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()


def gemv(d: Path, seconds: float) -> None:
    """Batch-1 decode-like work: memory-bound matrix-vector products, kernels back to back."""
    import torch
    w = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16384, 1, device="cuda", dtype=torch.bfloat16)
    ready(d)
    end = time.monotonic() + seconds
    while not (d / "release").exists() and time.monotonic() < end:
        for _ in range(50):
            w @ x
        torch.cuda.synchronize()


def wait_for_device() -> None:
    cp.cuda.Device().synchronize()


def spin(d: Path, seconds: float, blocks: int, threads: int) -> None:
    flag = Flag(d, seconds)
    flag.launch(blocks, threads)
    ready(d, blocks=blocks, threads=threads)
    wait_for_device()  # the host blocks in a device sync until the flag is set


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]  # passed by value, as nccl.h declares it


class NcclDirect:
    """NCCL through ctypes, one rank: the way vLLM's PyNccl calls it (no torch.distributed, no Flight Recorder)."""

    def __init__(self) -> None:
        try:  # torch loaded it already (its nvidia-nccl wheel); the soname finds that copy
            self.lib = ctypes.CDLL("libnccl.so.2")
        except OSError:
            import nvidia.nccl
            self.lib = ctypes.CDLL(glob.glob(f"{next(iter(nvidia.nccl.__path__))}/lib/libnccl.so*")[0])
        uid = NcclUniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        self.comm = ctypes.c_void_p()
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId,
                                              ctypes.c_int]
        self._check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), 1, uid, 0))
        self.lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"NCCL error {rc}")

    def all_reduce(self, t: object, stream: int) -> None:
        self._check(self.lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), 7, 0,  # float32, sum
                                           self.comm, ctypes.c_void_p(stream)))


def nccl(d: Path, seconds: float, bypass: bool) -> None:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    stream = torch.cuda.current_stream()
    direct = NcclDirect() if bypass else None
    for _ in range(5):
        if direct is not None:
            direct.all_reduce(x, stream.cuda_stream)
        else:
            dist.all_reduce(x)
    torch.cuda.synchronize()
    ready(d, phase="collectives done", bypass=bypass)
    while not (d / "go").exists():
        time.sleep(0.05)
    flag = Flag(d, seconds)
    flag.launch(132, 32, cp.cuda.ExternalStream(stream.cuda_stream))
    if direct is not None:
        direct.all_reduce(x, stream.cuda_stream)  # queued behind the spin
        (d / "stalled").write_text("1")
        torch.cuda.synchronize()
    else:
        dist.all_reduce(x)  # queued behind the spin: entered, never completes until released
        (d / "stalled").write_text("1")
        dist.barrier()  # the host blocks inside c10d until the device is free
    torch.cuda.synchronize()
    dist.destroy_process_group()


def nccl2(d: Path, seconds: float, rank: int) -> None:
    """Two ranks, one GPU each: rank 1 stops issuing collectives, rank 0 enters the next all-reduce and waits in
    NCCL's own kernel (a real collective hang). Released when DIR/release appears: rank 1 then joins."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 0:
        dist.all_reduce(x)  # rank 1 never comes (until released)
        (d / "stalled").write_text("1")
        ready(d / "r0")
        torch.cuda.synchronize()
    else:
        ready(d / "r1")
        wait_release(d, seconds)
        dist.all_reduce(x)
        torch.cuda.synchronize()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rank", type=int, default=0)
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    s = a.scenario
    if s == "idle":
        idle(a.dir, a.seconds)
    elif s == "matmul":
        matmul(a.dir, a.seconds)
    elif s == "gemv":
        gemv(a.dir, a.seconds)
    elif s == "spin":
        spin(a.dir, a.seconds, 1, 1)
    elif s == "spin_wide":
        spin(a.dir, a.seconds, 132 * 4, 256)
    elif s in ("nccl", "nccl_bypass"):
        nccl(a.dir, a.seconds, s == "nccl_bypass")
    elif s == "nccl2":
        (a.dir / f"r{a.rank}").mkdir(exist_ok=True)
        nccl2(a.dir, a.seconds, a.rank)
    else:
        raise SystemExit(f"unknown scenario {s}")


if __name__ == "__main__":
    main()
