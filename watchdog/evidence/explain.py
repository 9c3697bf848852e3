"""What each process of a frozen engine is doing, and who the others wait for. Pure: stacks in, verdicts out.

Frames match on function name (class qualifier dropped: py-spy 0.4 on Python 3.11+ prints ``SpinCondition.wait``,
older dumps ``wait``) plus a file suffix or path fragment, never on line numbers. A thread is read innermost
first: the first meaningful frame decides, and reader waits look outward for their owner (``worker_busy_loop``:
an idle worker; ``get_response``: EngineCore waiting for replies).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from watchdog.evidence.roles import Role, ranks_of, role_of_name, title_in
from watchdog.evidence.stacks import Frame, ProcessStack, ThreadStack


class Cls(StrEnum):
    IDLE_READER_WAIT = "idle_reader_wait"
    """Worker in worker_busy_loop waiting for the next broadcast: shm_broadcast acquire_read/dequeue with
    SpinCondition.wait/poll or the old spin/sched_yield, or the remote MessageQueue.recv ZMQ reader."""
    ENGINE_IDLE = "engine_idle"
    """EngineCore waiting for requests: _process_input_queue in queue.get (V0: run_engine_loop in poll)."""
    ENGINE_WAITING_WORKERS = "engine_waiting_workers"
    """EngineCore in a step waiting for replies: collective_rpc/get_response/FutureWrapper.result, or Ray DAG."""
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


@dataclass(frozen=True, slots=True)
class ProcessExplanation:
    name: str  # title without its "VLLM::"/"sglang::"/"ray::" prefix (Worker_TP1, EngineCore), else role[pid]
    pid: int | None
    role: Role | None  # None: neither the title nor a frame says
    rank: dict[str, int]
    cls: Cls
    thread: str  # the thread that decided
    frames: tuple[Frame, ...]  # the deciding frames, innermost first
    spec_decode: bool
    why: str
    spec_frames: tuple[Frame, ...] = ()


@dataclass(frozen=True, slots=True)
class CrossRankVerdict:
    culprit: str | None
    reason: str
    frames: tuple[Frame, ...]


@dataclass(frozen=True, slots=True)
class HypothesisVerdict:
    status: Status
    reason: str
    frames: tuple[Frame, ...]
    spec_frames: tuple[Frame, ...] = ()



_BUSY = (Cls.IN_COLLECTIVE, Cls.MODEL_FORWARD, Cls.DEVICE_WAIT, Cls.COMPILE)
_IDLE = (Cls.IDLE_READER_WAIT, Cls.ENGINE_IDLE)
_SEVERITY = [Cls.UNKNOWN, *_IDLE, Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING, Cls.MODEL_FORWARD,
             Cls.COMPILE, Cls.DEVICE_WAIT, Cls.IN_COLLECTIVE]  # which helper-thread class wins when main says nothing
_DEVICE_NATIVE = re.compile(r"(?:cu|cuda|hip|musa|ze|acl|aclrt)[A-Za-z]*Synchroni[sz]e|EventWait|_local_scalar_dense"
                            r"|cuMemcpyDtoH|cudaMemcpy(?!Async)|urQueueFinish")
_COLL_NATIVE = re.compile(r"^nccl|^rccl|^hccl|^mccl|gloo::|ProcessGroup(?:Gloo|NCCL|HCCL)|c10d::|shm_?all_?reduce")
_COMPILE_NATIVE = re.compile(r"llvm::|mlir::|triton::|nvrtc|ptxas|nvJitLink")
_COLL_FILES = ("distributed/", "device_communicators/", "communication_op", "parallel_state", "deep_ep/")
_COLL_FUNC = re.compile(r"all_?reduce|all_?gather|reduce_scatter|broadcast|barrier|all_to_all|dispatch|combine"
                        r"|^i?send|^i?recv|^gather|^scatter|^nccl")
_COLL_ANY = ("pynccl", "custom_all_reduce", "quick_all_reduce", "cpu_communicator.py", "symm_mem", "all2all")
_COMPILE_PARTS = ("torch/_dynamo/convert_frame", "torch/_dynamo/symbolic_convert", "torch/_dynamo/output_graph",
                  "torch/_functorch/aot_autograd", "torch/_inductor/", "triton/compiler/", "triton/backends/",
                  "triton/runtime/build", "triton/runtime/autotuner", "torch/utils/cpp_extension", "file_baton",
                  "/jit/", "tilelang/engine")
_COMPILE_NOT = ("_inductor/runtime/", "output_code.py", "subproc_pool.py", "cudagraph_trees", "_inductor/utils.py")
_MODEL_FUNCS = {"forward", "execute_model", "_model_forward", "_dummy_run", "execute_dummy_batch", "sample_tokens",
                "profile_run", "capture_model", "run_batch"}
_REPLY_FUNCS = {"get_response", "_wait_for_response", "collective_rpc"}
_REMOTE_EXECUTORS = ("multiproc_executor.py", "ray_executor.py", "ray_distributed_executor.py")
_SPEC = re.compile(r"spec_decode|speculative|eagle|medusa|ngram_proposer|ngram_worker|draft|_mtp|mtp_")
_STARTUP = {"init_device", "init_worker_distributed_environment", "compile_or_warm_up_model", "load_model",
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
def _base(f: Frame) -> str:
    name = f.function.rsplit("::", 1)[-1] if f.native else f.function
    return name.rsplit(".", 1)[-1]


def _spec_key(f: Frame) -> str:  # the last directory, file name and function: "spec_decode/eagle.py propose"
    return f"{'/'.join(f.file.split('/')[-2:])} {f.function}".lower()


def _noise(f: Frame) -> bool:  # raw addresses and libc/pthread plumbing in native dumps
    return f.native and (f.function.startswith("0x") or "libc." in f.file or "pthread" in f.file)


def _frame_role(f: Frame) -> Role | None:
    base = _base(f)
    if f.native or (base in _REPLY_FUNCS and not f.file.endswith(_REMOTE_EXECUTORS)):
        return None  # the in-process (uniproc) collective_rpc is no reply wait
    return next((role for role, part, funcs in _ROLE_FUNCS if base in funcs and part in f.file), None)


def _kind(f: Frame) -> Cls | str | None:
    """What one frame says on its own: a class, "reader", "input", "defer", "exit", or None (look further out)."""
    base, path = _base(f), f.file
    if f.native:
        if _DEVICE_NATIVE.search(base):
            return Cls.DEVICE_WAIT
        if _COLL_NATIVE.search(f.function):
            return Cls.IN_COLLECTIVE
        return Cls.COMPILE if _COMPILE_NATIVE.search(f"{f.function} {f.file}") else None
    if path.endswith("shm_broadcast.py") or "ray/experimental/channel/" in path:
        return Cls.WRITER_BLOCKED_FULL_RING if base in {"acquire_write", "enqueue"} else "reader"
    if (base in _REPLY_FUNCS and _frame_role(f)) or "compiled_dag_ref" in path or (
        base == "result" and path.endswith("multiproc_executor.py")
    ):
        return Cls.ENGINE_WAITING_WORKERS
    if any(p in path for p in _COLL_ANY) or (any(p in path for p in _COLL_FILES) and _COLL_FUNC.search(base)):
        return Cls.IN_COLLECTIVE
    if base == "synchronize" and any(p in path for p in ("torch/cuda/", "torch_npu/", "torch/xpu/", "cupy")):
        return Cls.DEVICE_WAIT
    vllm_compile = "vllm/compilation/" in path and "compile" in base  # not its runtime __call__ wrappers
    if vllm_compile or (any(p in path for p in _COMPILE_PARTS) and not any(p in path for p in _COMPILE_NOT)):
        return Cls.COMPILE
    if base in {"_process_input_queue", "run_engine_loop"}:
        return "input"
    if base == "resolve_batch_result":
        return "defer"  # sglang overlap scheduler: the main thread waits for its own forward thread
    if base == "_shutdown" and path.endswith("threading.py"):
        return "exit"
    spec = base in {"draft", "verify", "propose"} and _SPEC.search(path.lower())
    sampler = base == "sample" and ("sampler" in path or "model_runner" in path)
    executor = path.endswith(("_executor.py", "executor/abstract.py"))
    if not executor and (base in _MODEL_FUNCS or base.startswith("forward_") or spec or sampler):
        return Cls.MODEL_FORWARD
    return None


_Decision = tuple[Cls | None, int, int | None, str]  # class (None: defer to another thread), at, context, note


def _decide(frames: tuple[Frame, ...], role: Role | None) -> _Decision | None:
    for i, f in enumerate(frames):
        kind = _kind(f)
        if kind == "reader":
            ctx = next((j for j in range(i + 1, len(frames)) if _frame_role(frames[j])), None)
            owner = _frame_role(frames[ctx]) if ctx is not None else role
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


def _chain(frames: tuple[Frame, ...], at: int, ctx: int | None, whole: bool = False) -> tuple[Frame, ...]:
    """The matched frame, up to 3 inner frames (all of them for the model: the op is the news) and its callers."""
    start = 0 if whole else max(0, at - 3)
    while start < at and _noise(frames[start]):
        start += 1
    end = max(at + 4, ctx + 1 if ctx is not None and ctx - start < 8 else 0)
    python = next((j for j in range(at, len(frames)) if not frames[j].native), None)
    if python is not None and python < at + 10:
        end = max(end, python + 1)  # native dumps: reach the first Python frame
    return frames[start : min(end, start + 8, len(frames))]




def _helper(t: ThreadStack) -> bool:
    named = t.name != "MainThread" and _HELPER.search(t.name)
    return t.name != "MainThread" and bool(named or any(
        _HELPER.fullmatch(_base(f)) or "tqdm/_monitor" in f.file or "lmcache/" in f.file for f in t.frames))


def _main(ps: ProcessStack) -> ThreadStack | None:
    named = [t for t in ps.threads if t.name == "MainThread"]
    named += [t for t in ps.threads if ps.pid is not None and t.thread_id == str(ps.pid)]
    # Unnamed dumps (faulthandler, excerpts): the main thread is the one threading did not start.
    named += [t for t in ps.threads if t.frames and not _helper(t) and "_bootstrap_inner" not in map(_base, t.frames)]
    return named[0] if named else None


def _label(t: ThreadStack | None) -> str:
    return "no thread" if t is None else t.name or (f"thread {t.thread_id}" if t.thread_id else "unnamed thread")


def _where(frames: tuple[Frame, ...]) -> str:
    shown = [f for f in frames if not _noise(f)][:3] or list(frames[:1])
    return " < ".join(f"{f.function} ({f.file.rsplit('/', 1)[-1]})" for f in shown) or "no frames"


_WHY = {
    Cls.IDLE_READER_WAIT: "waits in the broadcast reader for the next step: idle, or the victim of a stuck peer",
    Cls.ENGINE_IDLE: "waits for new requests: nothing is scheduled",
    Cls.ENGINE_WAITING_WORKERS: "is inside a step waiting for the workers' replies",
    Cls.WRITER_BLOCKED_FULL_RING: "cannot write: every ring slot holds a block some reader has not consumed",
    Cls.IN_COLLECTIVE: "is inside a collective and waits for every peer of its group to join",
    Cls.DEVICE_WAIT: "is blocked until the device finishes its queued work",
    Cls.MODEL_FORWARD: "is running the model, with no collective or device wait on top",
    Cls.COMPILE: "is compiling, or waiting for a JIT build",
}


def classify(ps: ProcessStack, role: Role | None = None, proc_state: str | None = None) -> ProcessExplanation:
    """Explain one process from its stacks; `role` overrides the guess, `proc_state` is /proc's state letter."""
    token = title_in(ps.title)
    main = _main(ps)
    ordered = ([main] if main else []) + [t for t in ps.threads if t is not main]
    named = role_of_name(token) if token else None
    role = (role or (named if named != Role.PROCESS else None)
            or next((r for t in ordered for f in t.frames if (r := _frame_role(f))), None))
    name = token or (f"{role or 'process'}[{ps.pid}]" if ps.pid is not None else role or "process")
    working = [t for t in ordered if t is main or not _helper(t)]
    spec = tuple(dict.fromkeys(f for t in working for f in t.frames if _SPEC.search(_spec_key(f))))

    def done(cls: Cls, t: ThreadStack | None, frames: tuple[Frame, ...], why: str) -> ProcessExplanation:
        why += f" Speculative-decoding frames present: {_where(spec)}." if spec else ""
        rank = ranks_of(token)
        return ProcessExplanation(name, ps.pid, role, rank, cls, _label(t), frames, bool(spec), why, spec[:6])

    first = main or next((t for t in ordered if t.frames), None)
    top = _chain(first.frames, 0, None) if first and first.frames else ()
    if proc_state and proc_state[:1] in ("T", "t"):
        return done(Cls.STOPPED, first, top, f"{name} is stopped (state {proc_state}): it runs no code; "
                                             f"last frames: {_where(top)}.")
    decided = [(t, d) for t in working if (d := _decide(t.frames, role)) is not None]
    known = [(t, d) for t, d in decided if d[0] not in (None, Cls.UNKNOWN)]
    main_d = next((d for t, d in decided if t is main), None)
    main_note = main_d[3] if main_d else ("no frames" if main and not main.frames else "no recognised frame")
    best = next(((t, d) for t, d in known if t is main), None) or max(
        known, key=lambda td: _SEVERITY.index(td[1][0] or Cls.UNKNOWN), default=None
    )
    if best is None:
        what = f"main thread: {main_note}" if main else "no main thread in the dump and no other thread says more"
        return done(Cls.UNKNOWN, first, top, f"{name}: nothing recognised ({what}); top frames: {_where(top)}.")
    t, (cls, at, ctx, note) = best
    cls = cls or Cls.UNKNOWN
    frames = _chain(t.frames, at, ctx, whole=cls in (Cls.MODEL_FORWARD, Cls.COMPILE))
    startup = " during startup" if any(_base(f) in _STARTUP for f in t.frames) else ""
    via = f"; main thread: {main_note}" if t is not main and main else ""
    return done(cls, t, frames, f"{name} ({_label(t)}{via}) {_WHY[cls]}{startup}{note}: {_where(frames)}.")




def _names(expls: list[ProcessExplanation]) -> str:
    return ", ".join(e.name for e in expls)


def _state(e: ProcessExplanation) -> str:
    return f"{e.name} {e.cls.value} ({_where(e.frames)})"


def cross_rank(expls: list[ProcessExplanation], moved: dict[str, bool] | None = None) -> CrossRankVerdict:
    """Name the process the others wait for. `moved[name]`: did its stacks change between captures (then it is
    slow, not frozen)."""
    moved = moved or {}
    waiting = (Cls.ENGINE_WAITING_WORKERS, Cls.ENGINE_IDLE, Cls.WRITER_BLOCKED_FULL_RING)
    engine = next((e for e in expls if e.role == Role.ENGINE_CORE), None)
    workers = [e for e in expls if e.role in (Role.WORKER, Role.SCHEDULER, None)]
    workers_idle = bool(workers) and all(w.cls is Cls.IDLE_READER_WAIT for w in workers)

    def blame(pool: list[ProcessExplanation], say: Callable[[ProcessExplanation], str]) -> CrossRankVerdict:
        c = sorted(pool, key=lambda r: (bool(moved.get(r.name)), r.cls is Cls.UNKNOWN))[0]  # frozen ones first
        moving = "; its stacks moved between captures, so it is slow rather than frozen" if moved.get(c.name) else ""
        return CrossRankVerdict(c.name, f"{say(c)}{moving}.", c.frames)

    if stopped := [e for e in expls if e.cls is Cls.STOPPED]:
        rest = "; ".join(_state(e) for e in expls if e.cls is not Cls.STOPPED) or "no peers seen"
        return blame(stopped, lambda c: f"{c.name} is stopped and runs no code while the others wait: {rest}")
    if coll := [e for e in expls if e.cls is Cls.IN_COLLECTIVE]:
        peers = _names(coll)
        pool = workers + ([engine] if engine is not None and engine.cls not in waiting else [])
        others = [e for e in pool if e not in coll]
        if busy := [r for r in others if r.cls in _BUSY]:
            return blame(busy, lambda c: f"{_state(c)} while {peers} wait in a collective for it")
        if idle := [r for r in others if r.cls in _IDLE]:
            return blame(idle, lambda c: f"{c.name} is back in its idle reader loop while {peers} wait in a "
                                         "collective: it left or skipped that collective (a failed or desynchronised "
                                         "step) and only looks idle")
        if others:
            return blame(others, lambda c: f"{_state(c)} is not in the collective {peers} wait in")
        kinds = sorted({_base(e.frames[0]) for e in coll if e.frames})
        what = (f"different collectives ({', '.join(kinds)}): a mismatch" if len(kinds) > 1 else
                "the same collective: the transport (NCCL/gloo/network) or a rank missing from the dump is stuck")
        return CrossRankVerdict(None, f"every rank seen is inside {what}.", coll[0].frames)
    if engine is not None and engine.cls is Cls.ENGINE_WAITING_WORKERS:
        if slow := [w for w in workers if w.cls is not Cls.IDLE_READER_WAIT]:
            return blame(slow, lambda c: f"EngineCore waits for replies and {_state(c)} has not finished its step")
        if workers_idle:
            return CrossRankVerdict(None, "EngineCore waits for replies while every worker is parked in its reader: "
                                          "a lost wake-up, an unread block (see poll_parking) or a lost reply; no "
                                          "single rank to blame.", engine.frames)
    if engine is not None and workers_idle and engine.cls not in _IDLE:
        return blame([engine], lambda c: f"every worker waits for a broadcast EngineCore never sends; {_state(c)}")
    if all(e.cls in _IDLE for e in expls):
        return CrossRankVerdict(None, "every process is idle: nobody waits on anyone.", ())
    return CrossRankVerdict(None, f"no process is seen waiting on another ({'; '.join(map(_state, expls))}).", ())


def poll_parking(expls: list[ProcessExplanation], work_pending: bool | None,
                 stacks_changed: bool | None) -> HypothesisVerdict:
    """Test poll-parking: work pending, EngineCore waiting on workers, every worker parked in its reader, no rank
    busy, nothing moving. Speculative-decoding frames (the rival hypothesis) are reported whatever the status."""
    spec = tuple(f for e in expls for f in e.spec_frames)
    rival = (f" Speculative-decoding frames seen in {_names([e for e in expls if e.spec_decode])} ({_where(spec)}): "
             "the rival hypothesis is a stall in the draft/verify path." if spec else "")

    def verdict(status: Status, reason: str, frames: tuple[Frame, ...] = ()) -> HypothesisVerdict:
        return HypothesisVerdict(status, reason + rival, frames, spec)

    engine = next((e for e in expls if e.role == Role.ENGINE_CORE), None)
    workers = [e for e in expls if e.role == Role.WORKER]
    if work_pending is False:
        return verdict(Status.NOT_APPLICABLE, "No work is pending: parked readers are simply idle.")
    if busy := [e for e in expls if e.cls in (*_BUSY, Cls.STOPPED)]:
        return verdict(Status.CONTRADICTED, f"{_state(busy[0])}: a rank is busy, waiting on peers or stopped; the "
                                            "readers wait on it, not on a lost wake-up.", busy[0].frames)
    if stacks_changed:
        return verdict(Status.CONTRADICTED, "Stacks moved between captures: the engine is progressing.")
    if engine is not None and engine.cls is Cls.ENGINE_IDLE and work_pending:
        return verdict(Status.CONTRADICTED, "EngineCore waits for requests, not for workers: the pending work is "
                                            "held elsewhere (a connector, the scheduler).", engine.frames)
    missing = [] if engine else ["no EngineCore stack"]
    if engine is not None and engine.cls not in (Cls.ENGINE_WAITING_WORKERS, Cls.WRITER_BLOCKED_FULL_RING):
        missing.append(f"EngineCore is {engine.cls.value}, not waiting on a reply or blocked writing")
    if others := [w for w in workers if w.cls is not Cls.IDLE_READER_WAIT]:
        missing.append("not in reader wait: " + ", ".join(f"{w.name} ({w.cls.value})" for w in others))
    missing += [] if workers else ["no worker stacks"]
    missing += [] if work_pending is not None else ["work state unknown"]
    missing += [] if stacks_changed is not None else ["single capture: parked cannot be told from passing through"]
    if missing or engine is None:
        return verdict(Status.INCONCLUSIVE, "Cannot decide: " + "; ".join(missing) + ".")
    return verdict(Status.SUPPORTED, f"Work pending; {_state(engine)}; all {len(workers)} workers parked in the reader "
                                     f"({_where(workers[0].frames)}); no rank busy; stacks unchanged between captures.",
                   engine.frames + workers[0].frames)
