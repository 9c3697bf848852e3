"""The [gpu] section: GPU evidence (NVML power beside the stacks, NCCL RAS, the Flight Recorder). Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuSection:
    enabled: bool = True  # sample NVML (nothing happens without a GPU, a driver or nvidia-ml-py)
    interval: float = 5.0  # normal sampling: ~0.01 % of a core on an H200 (bench/results/gpu.json)
    dense_interval: float = 0.5  # from a suspicion on ...
    dense_for: float = 120.0  # ... for this long
    keep_seconds: float = 600.0  # samples kept for the bundle's timeline
    busy_util: int = 90  # percent: a kernel resident nearly all the time
    spin_power_fraction: float = 0.25  # busy at or below this share of the power limit: a kernel spinning
    ras: bool = True  # ask NCCL RAS (NCCL 2.24+) on suspicion
    ras_address: str = "127.0.0.1:28028"  # NCCL_RAS_ADDR of the engine
    ras_timeout: float = 5.0
    flight_recorder: bool = True  # on a freeze, make every rank's Flight Recorder dump (when its pipe is set)
    fr_settle: float = 10.0  # wait at most this long for the dumps before anything is restarted
    native: bool = True  # py-spy --native for engine processes holding a GPU (their waits are in CUDA/NCCL frames)
    # The recorder's pipe and dump prefixes (TORCH_NCCL_DEBUG_INFO_PIPE_FILE, TORCH_FR_DUMP_TEMP_FILE) for engines whose
    # /proc/PID/environ does not show them (vLLM's setproctitle can overwrite it; or start the engine with SPT_NOENV=1)
    fr_pipe_prefix: str = ""
    fr_dump_prefix: str = ""


def ras_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"gpu.ras_address must be host:port, got {address!r}")
    return host, int(port)


def check_gpu(g: GpuSection) -> None:
    """Raises ValueError naming the key."""
    for key in ("interval", "dense_interval", "dense_for", "keep_seconds", "ras_timeout", "fr_settle"):
        if not getattr(g, key) > 0:
            raise ValueError(f"gpu.{key} must be greater than 0, got {getattr(g, key)!r}")
    if g.dense_interval > g.interval:
        raise ValueError(f"gpu.dense_interval ({g.dense_interval:g}) must not exceed gpu.interval ({g.interval:g})")
    if not 0 < g.spin_power_fraction < 1:
        raise ValueError(f"gpu.spin_power_fraction must be between 0 and 1, got {g.spin_power_fraction!r}")
    if not 0 < g.busy_util <= 100:
        raise ValueError(f"gpu.busy_util must be 1..100, got {g.busy_util!r}")
    if g.fr_settle > 60:
        raise ValueError(f"gpu.fr_settle must be at most 60 s (a restart waits for it), got {g.fr_settle!r}")
    ras_host_port(g.ras_address)
    if bool(g.fr_pipe_prefix) != bool(g.fr_dump_prefix):
        raise ValueError("gpu.fr_pipe_prefix and gpu.fr_dump_prefix go together (the pipe to ask, the file it writes)")
