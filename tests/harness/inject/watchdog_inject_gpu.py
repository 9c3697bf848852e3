"""The GPU faults of `watchdog_inject` (tests and device recordings only), imported when one fires, never at start.

- `spin(seconds)`: one kernel on the current stream that spins on the SM clock for about ``seconds``
  (``torch.cuda._sleep``, calibrated here on this GPU): every kernel queued after it waits, and so does the host
  thread that next synchronises, as behind a kernel that never ends. It ends by itself, so the engine lives on.
- `illegal_access()`: one Triton kernel that stores far past the end of a real allocation: the GPU raises
  ``CUDA error: an illegal memory access was encountered`` at the next synchronisation, and the CUDA context is lost
  (the process cannot use the GPU again), as in the crash of a real out-of-bounds kernel.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

_CALIBRATE_CYCLES = 200_000_000
_rate: list[float] = []  # SM clock cycles per second, measured once


def _cycles_per_second() -> float:
    if not _rate:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(_CALIBRATE_CYCLES)
        end.record()
        end.synchronize()
        _rate.append(_CALIBRATE_CYCLES / (start.elapsed_time(end) / 1000.0))
    return _rate[0]


def spin(seconds: float) -> int:
    """Queue a kernel of about ``seconds`` on the current stream; returns its cycles."""
    cycles = int(seconds * _cycles_per_second())
    torch.cuda._sleep(cycles)
    return cycles


@triton.jit  # type: ignore[untyped-decorator,unused-ignore]
def _store_far(ptr, offset):  # type: ignore[no-untyped-def]  # no annotations: Triton reads them as globals
    tl.store(ptr + offset, 1)


def illegal_access() -> None:
    """A store 4 Ti elements past a one-element tensor: outside every mapping of the device's address space."""
    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    _store_far[(1,)](x, 1 << 42)
