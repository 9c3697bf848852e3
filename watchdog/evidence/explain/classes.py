"""The classes a process's main thread gets, and the statuses of the poll-parking hypothesis. Pure."""

from __future__ import annotations

from enum import StrEnum


class Cls(StrEnum):
    IDLE_READER_WAIT = "idle_reader_wait"
    """Worker in worker_busy_loop waiting for the next broadcast: shm_broadcast acquire_read/dequeue with
    SpinCondition.wait/poll or the old spin/sched_yield, or the remote MessageQueue.recv ZMQ reader."""
    ENGINE_IDLE = "engine_idle"
    """EngineCore waiting for requests: _process_input_queue in queue.get (V0: run_engine_loop in poll)."""
    ENGINE_WAITING_WORKERS = "engine_waiting_workers"
    """EngineCore in a step waiting for replies: collective_rpc/get_response/FutureWrapper.result, or Ray DAG."""
    ENGINE_LOOP = "engine_loop"
    """EngineCore in its own loop, outside the model and not waiting: scheduling, bookkeeping, an empty step
    (vLLM V1 scheduler.schedule/update_from_output, EngineCore.step/_process_engine_step/run_busy_loop)."""
    WRITER_BLOCKED_FULL_RING = "writer_blocked_full_ring"
    """Writer stuck in shm_broadcast acquire_write/enqueue: every slot holds a block some reader has not read."""
    IN_COLLECTIVE = "in_collective"
    """Collective or rendezvous: NCCL/pynccl, custom/quick/CPU-shm all-reduce, gloo, c10d, ncclCommInitRank, EP."""
    DEVICE_WAIT = "device_wait"
    """Host waiting on the device: cu*/cuda*/acl* synchronize, .item()/.cpu() readbacks, urEventWait, NPU sync."""
    MODEL_FORWARD = "model_forward"
    """In the model (forward, execute_model, sampling, draft/verify) with no collective or device wait on top."""
    COMPILE = "compile"
    """JIT/graph compile: dynamo/inductor, triton, cpp_extension, flashinfer/deep_gemm JIT, LLVM, their file locks."""
    STOPPED = "stopped"
    """Process state T (SIGSTOP, a debugger) as reported by the caller: it runs no code at all."""
    UNKNOWN = "unknown"
    """Nothing recognised (also: interpreter shutdown, a main thread missing from an excerpt)."""


class Status(StrEnum):
    SUPPORTED = "SUPPORTED"
    CONTRADICTED = "CONTRADICTED"
    INCONCLUSIVE = "INCONCLUSIVE"
    NOT_APPLICABLE = "NOT_APPLICABLE"
