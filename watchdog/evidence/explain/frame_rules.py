"""What one frame says, and which frame of a thread decides: the frame rules of the explanation. Pure.

Frames match on function name (class qualifier dropped: py-spy 0.4 on Python 3.11+ prints ``SpinCondition.wait``,
older dumps ``wait``) plus a file suffix or path fragment, never on line numbers. A thread is read innermost
first: the first meaningful frame decides, and reader waits look outward for their owner (``worker_busy_loop``:
an idle worker; ``get_response``: EngineCore waiting for replies).
"""

from __future__ import annotations

import re

from watchdog.core.roles import Role
from watchdog.evidence.explain.classes import Cls
from watchdog.evidence.stacks.frames import Frame, ProcessStack, ThreadStack

DEVICE_NATIVE = re.compile(r"(?:cu|cuda|hip|musa|ze|acl|aclrt)[A-Za-z]*Synchroni[sz]e|EventWait|_local_scalar_dense"
                            r"|cuMemcpyDtoH|cudaMemcpy(?!Async)|urQueueFinish"
                            r"|^(?:cu|cuda|hip)(?:Event|Stream)Query")  # blocking-wait loops poll these
# NCCL's launch path (ncclGroupEnd > groupLaunch > doLaunches > ncclLaunchKernel) and proxy threads, torch's own
# NCCL binding, NVSHMEM (DeepEP), MSCCL++.
COLL_NATIVE = re.compile(r"^nccl|^rccl|^hccl|^mccl|gloo::|ProcessGroup(?:Gloo|NCCL|HCCL)|c10d::|shm_?all_?reduce"
                          r"|^(?:groupLaunch|doLaunches|proxyProgress\w*|persistentSocketThread)\b"
                          r"|torch::cuda::nccl::|^nvshmem|^mscclpp")
_COMPILE_NATIVE = re.compile(r"llvm::|mlir::|triton::|nvrtc|ptxas|nvJitLink")
# Kernel stacks: a frame inside a GPU/accelerator driver module means the process waits on (or spins in) the driver.
DRIVER_MODULES = re.compile(r"^(?:nvidia\w*|amdgpu|amdkfd|habanalabs|xe|i915|neuron\w*|ascend\w*|davinci\w*)$")
# SGLang's overlap scheduler: the main thread waits for its own forward thread (or the copy of its result).
_DEFER = {"resolve_batch_result", "resolve_last_batch_result"}
_COLL_FILES = ("distributed/", "device_communicators/", "communication_op", "parallel_state", "deep_ep/")
COLL_FUNC = re.compile(r"all_?reduce|all_?gather|reduce_scatter|broadcast|barrier|all_to_all|dispatch|combine"
                        r"|^i?send|^i?recv|^gather|^scatter|^nccl")
_COLL_ANY = ("pynccl", "custom_all_reduce.py", "quick_all_reduce", "cpu_communicator.py", "symm_mem", "all2all")
_COMPILE_PARTS = ("torch/_dynamo/convert_frame", "torch/_dynamo/symbolic_convert", "torch/_dynamo/output_graph",
                  "torch/_functorch/aot_autograd", "torch/_inductor/", "triton/compiler/", "triton/backends/",
                  "triton/runtime/build", "triton/runtime/autotuner", "torch/utils/cpp_extension", "file_baton",
                  "/jit/", "tilelang/engine")
_COMPILE_NOT = ("_inductor/runtime/", "output_code.py", "subproc_pool.py", "cudagraph_trees", "_inductor/utils.py")
_MODEL_FUNCS = {"forward", "execute_model", "_model_forward", "_dummy_run", "execute_dummy_batch", "sample_tokens",
                "profile_run", "capture_model", "run_batch"}
# EngineCore's own loop (scheduling, bookkeeping, an empty step): innermost-first, so only when nothing inside decides.
_LOOP_FUNCS = {"schedule", "update_from_output", "step", "step_with_batch_queue", "_process_engine_step", "post_step",
               "run_busy_loop", "_process_aborts_queue", "get_grammar_bitmask", "make_stats", "_handle_client_request"}
_LOOP_FILES = ("vllm/v1/core/sched/", "vllm/v1/engine/core.py")
_REPLY_FUNCS = {"get_response", "_wait_for_response", "collective_rpc"}
_REMOTE_EXECUTORS = ("multiproc_executor.py", "ray_executor.py", "ray_distributed_executor.py")
SPEC = re.compile(r"spec_decode|speculative|eagle|medusa|ngram_proposer|ngram_worker|draft|_mtp|mtp_")
STARTUP = {"init_device", "init_worker_distributed_environment", "compile_or_warm_up_model", "load_model",
            "_initialize_kv_caches", "profile_run", "capture_model", "warmup_kernels", "determine_available_memory"}
_WAIT_FILES = ("zmq/", "threading.py", "queue.py", "selectors.py", "contextlib.py")
# Background threads never decide (matched on thread names and on function names).
_HELPER = re.compile(r"DeathPipeMonitor|MultiprocWorkerMonitor|process_input_sockets|process_output_sockets"
                     r"|tqdm_monitor|WorkerAsyncOutputCopy|signal-callback|watchdog_thread|_read_thread|mq-client"
                     r"|InductorSubproc|monitor_workers|death_pipe_monitor|monitor_parent_death|async_output_busy_loop"
                     r"|pyspy_dump\w*")
_ROLE_FUNCS = (  # (role, a fragment the file path must hold, functions)
    (Role.WORKER, "", {"worker_busy_loop", "worker_main", "do_exec_tasks", "execute_method"}),
    (Role.ENGINE_CORE, "engine", {"run_busy_loop", "run_engine_core", "_process_engine_step", "_process_input_queue",
                                  "step", "step_with_batch_queue", "process_input_sockets", "process_output_sockets",
                                  "run_engine_loop", "engine_step"}),
    (Role.ENGINE_CORE, "executor", _REPLY_FUNCS),
    (Role.SCHEDULER, "scheduler", {"event_loop_normal", "event_loop_overlap", "run_scheduler_process"}),
)


def base_name(f: Frame) -> str:
    name = f.function.rsplit("::", 1)[-1] if f.native else f.function
    return name.rsplit(".", 1)[-1]


def spec_key(f: Frame) -> str:  # the last directory, file name and function: "spec_decode/eagle.py propose"
    return f"{'/'.join(f.file.split('/')[-2:])} {f.function}".lower()


def is_noise(f: Frame) -> bool:  # raw addresses, gdb's "??" and libc/pthread plumbing in native dumps
    return f.native and (f.function.startswith(("0x", "??")) or "libc." in f.file or "pthread" in f.file)


def frame_role(f: Frame) -> Role | None:
    base = base_name(f)
    if f.native or (base in _REPLY_FUNCS and not f.file.endswith(_REMOTE_EXECUTORS)):
        return None  # the in-process (uniproc) collective_rpc is no reply wait
    return next((role for role, part, funcs in _ROLE_FUNCS if base in funcs and part in f.file), None)


def _kind(f: Frame) -> Cls | str | None:
    """What one frame says on its own: a class, "reader", "input", "defer", "exit", or None (look further out)."""
    base, path = base_name(f), f.file
    if f.native:
        if DEVICE_NATIVE.search(f.function) or DRIVER_MODULES.match(f.file):
            return Cls.DEVICE_WAIT
        if COLL_NATIVE.search(f.function):
            return Cls.IN_COLLECTIVE
        return Cls.COMPILE if _COMPILE_NATIVE.search(f"{f.function} {f.file}") else None
    if path.endswith("shm_broadcast.py") or "ray/experimental/channel/" in path:
        return Cls.WRITER_BLOCKED_FULL_RING if base in {"acquire_write", "enqueue"} else "reader"
    if (base in _REPLY_FUNCS and frame_role(f)) or "compiled_dag_ref" in path or (
        base == "result" and path.endswith("multiproc_executor.py")
    ):
        return Cls.ENGINE_WAITING_WORKERS
    if any(p in path for p in _COLL_ANY) or (any(p in path for p in _COLL_FILES) and COLL_FUNC.search(base)):
        return Cls.IN_COLLECTIVE
    if base == "synchronize" and any(p in path for p in ("torch/cuda/", "torch_npu/", "torch/xpu/", "cupy")):
        return Cls.DEVICE_WAIT
    if base == "get_output" and "vllm/v1/worker/" in path:
        return Cls.DEVICE_WAIT  # AsyncModelRunnerOutput.get_output: copy_event.synchronize, the device-to-host copy
    vllm_compile = "vllm/compilation/" in path and "compile" in base  # not its runtime __call__ wrappers
    if vllm_compile or (any(p in path for p in _COMPILE_PARTS) and not any(p in path for p in _COMPILE_NOT)):
        return Cls.COMPILE
    if base in {"_process_input_queue", "run_engine_loop"}:
        return "input"
    if base in _LOOP_FUNCS and any(p in path for p in _LOOP_FILES):
        return Cls.ENGINE_LOOP
    if base in _DEFER:
        return "defer"  # sglang overlap scheduler: the main thread waits for its own forward thread
    if base == "_shutdown" and path.endswith("threading.py"):
        return "exit"
    spec = base in {"draft", "verify", "propose"} and SPEC.search(path.lower())
    sampler = base == "sample" and ("sampler" in path or "model_runner" in path)
    executor = path.endswith(("_executor.py", "executor/abstract.py"))
    loop = base.startswith("forward_thread_func")  # SGLang's overlap forward-thread loop, not a model forward
    if not executor and not loop and (base in _MODEL_FUNCS or base.startswith("forward_") or spec or sampler):
        return Cls.MODEL_FORWARD
    return None


FrameDecision = tuple[Cls | None, int, int | None, str]  # class (None: defer to another thread), at, context, note


def decide(frames: tuple[Frame, ...], role: Role | None) -> FrameDecision | None:
    for i, f in enumerate(frames):
        kind = _kind(f)
        if kind == "reader":
            ctx = next((j for j in range(i + 1, len(frames)) if frame_role(frames[j])), None)
            owner = frame_role(frames[ctx]) if ctx is not None else role
            cut = "" if ctx is not None else " (caller frames cut: owner taken from the role)"
            if owner == Role.ENGINE_CORE:
                return Cls.ENGINE_WAITING_WORKERS, i, ctx, cut
            return Cls.IDLE_READER_WAIT, i, ctx, cut if owner else " (caller frames cut: taken as a worker's reader)"
        if kind == "input":
            if all(g.native or any(p in g.file for p in _WAIT_FILES) for g in frames[:i]):  # only waits inside
                return Cls.ENGINE_IDLE, i, None, ""
        elif kind == "defer":
            return None, i, None, "waits for its own forward thread"
        elif kind == "exit":
            return Cls.UNKNOWN, i, None, "the interpreter is shutting down (threading._shutdown)"
        elif kind is not None:
            return Cls(kind), i, None, ""
    return None


def chain(frames: tuple[Frame, ...], at: int, ctx: int | None, whole: bool = False) -> tuple[Frame, ...]:
    """The matched frame, up to 3 inner frames (all of them for the model: the op is the news) and its callers."""
    start = 0 if whole else max(0, at - 3)
    while start < at and is_noise(frames[start]):
        start += 1
    end = max(at + 4, ctx + 1 if ctx is not None and ctx - start < 8 else 0)
    python = next((j for j in range(at, len(frames)) if not frames[j].native), None)
    if python is not None and python < at + 10:
        end = max(end, python + 1)  # native dumps: reach the first Python frame
    return frames[start : min(end, start + 8, len(frames))]


def is_helper(t: ThreadStack) -> bool:
    named = t.name != "MainThread" and _HELPER.search(t.name)
    return t.name != "MainThread" and bool(named or any(
        _HELPER.fullmatch(base_name(f)) or "tqdm/_monitor" in f.file or "lmcache/" in f.file for f in t.frames))


def _started_by_threading(t: ThreadStack) -> bool:
    return any(f.file.endswith("threading.py") and base_name(f) in ("run", "_bootstrap", "_bootstrap_inner")
               for f in t.frames)


def main_thread(ps: ProcessStack) -> ThreadStack | None:
    named = [t for t in ps.threads if t.name == "MainThread"]
    named += [t for t in ps.threads if ps.pid is not None and t.thread_id == str(ps.pid)]
    # Unnamed dumps (faulthandler, tracebacks, excerpts): the main thread is the one threading did not start.
    named += [t for t in ps.threads if t.frames and not is_helper(t) and not _started_by_threading(t)]
    return named[0] if named else None
