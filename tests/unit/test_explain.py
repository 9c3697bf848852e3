"""Classification of every corpus dump, and cross-rank verdicts on stacks built from the frames seen on vLLM 0.32."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from watchdog.evidence.explain import Cls, ProcessExplanation, Status, classify, cross_rank, poll_parking
from watchdog.evidence.stacks import ProcessStack, parse_any, parse_pyspy_json, parse_text

DUMPS = Path(__file__).resolve().parents[1] / "data" / "dumps"


def names(e: ProcessExplanation) -> list[str]:
    return [f.function for f in e.frames]


# ------------------------------------------------------------------------------------------ the corpus

# file -> one row per parsed process: (name, role, rank, class, deciding thread, deciding frames, spec_decode).
# The hand class from INDEX.md is in the trailing comment; where it differs the comment says why.
C = Cls
CORPUS: dict[str, list[tuple[str, str | None, dict[str, int], Cls, str, list[str], bool]]] = {
    "sglang-11208-scheduler-forward-thread-nccl-window-register.txt": [
        # hand: nccl_collective. MainThread's top is cut from the excerpt, so the forward thread decides.
        ("scheduler", "scheduler", {}, C.IN_COLLECTIVE, "Thread-2 (forward_thread_func)",
         ["ncclCommWindowRegister", "register_comm_window_raw", "__exit__", "forward"], False)],
    "sglang-12076-scheduler-tp6-eagle-verify-penalty.txt": [
        ("process", None, {}, C.UNKNOWN, "unnamed thread", ["_bootstrap_inner", "_bootstrap"], False),  # TP3's tail
        # hand: model_forward (EAGLE verify), flagged spec_decode too.
        ("scheduler_TP6", "scheduler", {"TP": 6}, C.MODEL_FORWARD, "MainThread",
         ["_apply", "apply", "apply", "apply_logits_bias", "verify", "verify", "forward_batch_generation"], True)],
    "sglang-17941-scheduler-pp2-tp1-gloo-recv.txt": [
        ("process", None, {}, C.UNKNOWN, "unnamed thread",
         ["0x7f259f401d71", "0x7f259f40d2be", "PyThread_acquire_lock_timed", "wait"], False),  # PP1's tail
        # hand: other:gloo_p2p_recv. Here a gloo recv is a cross-rank wait like any collective: in_collective.
        ("scheduler_PP2_TP1", "scheduler", {"PP": 2, "TP": 1}, C.IN_COLLECTIVE, "MainThread",
         ["gloo::transport::tcp::UnboundBuffer::waitRecv", "c10d::ProcessGroupGloo::RecvWork::wait"], False)],
    "sglang-24588-scheduler-mainthread-quant-op-during-jit-deadlock.txt": [
        # hand: model_forward (hard negative for compile). forward_target_extend in eagle_worker.py: spec_decode.
        ("process", None, {}, C.MODEL_FORWARD, "MainThread",
         ["__call__", "sgl_per_token_group_quant_8bit", "sglang_per_token_group_quant_fp8",
          "deepgemm_w8a8_block_fp8_linear_with_fallback", "apply", "forward", "_call_impl", "_wrapped_call_impl"],
         True)],
    "sglang-31178-scheduler-tp6-threading-shutdown-native.txt": [
        # hand: other:interpreter_shutdown_join. Our set has no "exiting" class: unknown, and `why` says shutdown.
        ("scheduler_TP6", "scheduler", {"TP": 6}, C.UNKNOWN, "MainThread",
         ["0x7f1398316d71", "0x7f1398322fb8", "PyThread_acquire_lock_timed", "_shutdown"], False)],
    "sglang-4257-tp0-forward-thread-flashinfer-prefill.txt": [
        # hand: model_forward. MainThread waits on its own forward thread (resolve_batch_result), which decides.
        ("scheduler_None", "scheduler", {}, C.MODEL_FORWARD, "Thread-3 (forward_thread_func)",
         ["__call__", "__torch_function__", "__call__", "ragged_run", "run", "forward_return_lse", "forward_extend",
          "forward"], False)],
    "sglang-5034-dp0-tp0-flashinfer-jit-filelock.txt": [
        # hand: jit_compile.
        ("scheduler_DP0_TP0", "scheduler", {"DP": 0, "TP": 0}, C.COMPILE, "Thread-4 (forward_thread_func)",
         ["acquire", "__enter__", "load_cuda_ops", "get_cascade_module", "merge_state", "forward_extend"], False)],
    "sglang-6891-scheduler-dp1-tp3-eagle-draft.txt": [
        # hand: model_forward (EAGLE draft).
        ("scheduler_DP1_TP3", "scheduler", {"DP": 1, "TP": 3}, C.MODEL_FORWARD, "MainThread",
         ["draft", "forward_batch_speculative_generation", "run_batch", "event_loop_normal"], True)],
    "vllm-15687-ray-worker-ncclCommInitRank-faulthandler.txt": [
        # hand: other:nccl_comm_init ("closest: nccl_collective"). ncclCommInitRank is a rendezvous of every rank,
        # so it is in_collective here; `why` adds "during startup".
        ("RayWorkerWrapper", "worker", {}, C.IN_COLLECTIVE, "unnamed thread",
         ["ncclCommInitRank", "__init__", "__init__", "__init__"], False)],
    "vllm-17676-enginecore-flashinfer-sampling-warmup.txt": [
        # hand: other:startup_warmup_sampler_kernel ("closest: model_forward"): model_forward, `why` says startup.
        ("EngineCore", "engine_core", {}, C.MODEL_FORWARD, "thread 2403",
         ["top_k_top_p_sampling_from_logits", "_auto_dump_wrapper", "flashinfer_sample", "sample", "__call__",
          "sample", "sample_tokens"], False)],
    "vllm-18466-worker-v1-abort-in-acquire-read-faulthandler.txt": [
        # hand: shm_reader_poll. Found as main thread although faulthandler names no thread.
        ("worker", "worker", {}, C.IDLE_READER_WAIT, "thread 0x00007f581410d000",
         ["acquire_read", "__enter__", "dequeue", "worker_busy_loop"], False)],
    "vllm-2479-v0-ray-worker-all-gather.txt": [
        # hand: nccl_collective.
        ("worker", "worker", {}, C.IN_COLLECTIVE, "MainThread",
         ["all_gather_into_tensor", "wrapper", "tensor_model_parallel_all_gather", "_get_logits"], False)],
    "vllm-50835-enginecore-ray-pp-dequeue-recv.txt": [
        # hand: shm_reader_poll (EngineCore side). Same state; our vocabulary names the EngineCore-side reader
        # engine_waiting_workers because get_response sits above it.
        ("EngineCore", "engine_core", {}, C.ENGINE_WAITING_WORKERS, "MainThread",
         ["poll", "poll", "recv", "dequeue", "get_response", "_wait_for_response"], False)],
    "vllm-ascend-repo53773705266-worker-ep72-npu-sync-acl-graph-dummy-run.txt": [
        # hand: cuda_sync (NPU).
        ("worker", "worker", {}, C.DEVICE_WAIT, "MainThread",
         ["synchronize", "__call__", "_model_forward", "_dummy_run"], False)],
    "vllm-lmcache-4759-enginecore-background-threads-idle.txt": [
        # hand: idle_wait_requests, taken from the poster's prose. DISAGREE: the excerpt holds only the last frame
        # of MainThread (<module>) and helper threads, which never decide. The dump alone cannot say idle: unknown.
        ("engine_core", "engine_core", {}, C.UNKNOWN, "unnamed thread", ["<module>"], False)],
    "vllm-pr41834-worker-tp0-ep0-idle-shm-poll.txt": [
        # hand: shm_reader_poll (healthy idle).
        ("Worker_TP0_EP0", "worker", {"TP": 0, "EP": 0}, C.IDLE_READER_WAIT, "MainThread",
         ["poll", "wait", "acquire_read", "dequeue", "worker_busy_loop"], False)],
    # hand: cuda_sync. DISAGREE (cannot read): a hand-condensed gdb backtrace is no format we parse; see test below.
    "vllm-pr41834-worker-tp0-gdb-cuStreamSynchronize-item.txt": [],
    "vllm-repo54367556517-ray-worker-pynccl-init-ncclAllReduce.txt": [
        # hand: nccl_collective (warm-up all-reduce at init).
        ("process", None, {}, C.IN_COLLECTIVE, "MainThread", ["ncclAllReduce", "all_reduce", "__init__", "__init__"],
         False)],
    "vllm-repo55180035228-enginecore-response-mq-poll-locals.txt": [
        # hand: shm_reader_poll (EngineCore). DISAGREE without a role: the author cut every frame above dequeue, so
        # nothing shows whose queue this is; it reads as a worker's reader. Given role="engine_core" (the caller knows
        # the process title) it is engine_waiting_workers: see test_trimmed_reader_takes_its_owner_from_the_role.
        ("process", None, {}, C.IDLE_READER_WAIT, "MainThread", ["poll", "wait", "acquire_read", "dequeue"], False)],
    "vllm-repo55536668370-enginecore-idle-input-queue.txt": [
        # hand: idle_wait_requests.
        ("engine_core", "engine_core", {}, C.ENGINE_IDLE, "MainThread",
         ["wait", "get", "_process_input_queue", "run_busy_loop"], False)],
    "vllm-repo68901464014-enginecore-xpu-urEventWait-gdn-metadata.txt": [
        # hand: cuda_sync (XPU). The header names MTP speculative decoding, but no frame shows it: spec_decode False.
        ("engine_core", "engine_core", {}, C.DEVICE_WAIT, "MainThread",
         ["ur::level_zero::urEventWait", "build", "build_attn_metadata", "prepare_attn"], False)],
    "vllm-v0-musa-repo71281069120-driver-rank0-broadcast-tensor-dict.txt": [
        # hand: nccl_collective; V0 driver = the engine process (run_engine_loop).
        ("engine_core", "engine_core", {}, C.IN_COLLECTIVE, "unnamed thread",
         ["broadcast", "wrapper", "broadcast_tensor_dict", "broadcast_tensor_dict"], False)],
    "gpu-pyspy-native-wedged.txt": [
        # no hand class; INDEX-free H200 capture of a host blocked in a device sync behind a spinning kernel.
        ("process[552]", None, {}, C.DEVICE_WAIT, "MainThread",
         ["cuCtxSynchronize_v2", "libcudart_static_ff466e58390a44a174cd1b2084ede65f6033356c", "cudaDeviceSynchronize",
          "runtime_deviceSynchronize", "Device_synchronize", "synchronize", "synchronize", "wait_for_device"], False)],
    "gpu-pyspy-wedged.txt": [
        # the same process without --native: the sync is a C call, invisible in Python frames. Unknown, honestly.
        ("process[552]", None, {}, C.UNKNOWN, "MainThread", ["wait_for_device", "<module>"], False)],
}


def test_every_corpus_file_is_covered() -> None:
    assert sorted(CORPUS) == sorted(p.name for p in DUMPS.glob("*.txt"))


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_classification(name: str) -> None:
    got = [classify(ps) for ps in parse_any((DUMPS / name).read_bytes())]
    assert [(e.name, e.role, e.rank, e.cls, e.thread, names(e), e.spec_decode) for e in got] == CORPUS[name]
    for e in got:
        assert e.why.endswith(".") and e.name in e.why


def test_why_sentences_say_what_matters() -> None:
    def why(name: str) -> str:
        return classify(parse_any((DUMPS / name).read_bytes())[-1]).why

    assert "shutting down" in why("sglang-31178-scheduler-tp6-threading-shutdown-native.txt")
    assert "during startup" in why("vllm-17676-enginecore-flashinfer-sampling-warmup.txt")
    assert "during startup" in why("vllm-15687-ray-worker-ncclCommInitRank-faulthandler.txt")
    assert "waits for its own forward thread" in why("sglang-4257-tp0-forward-thread-flashinfer-prefill.txt")
    assert "Speculative-decoding frames" in why("sglang-6891-scheduler-dp1-tp3-eagle-draft.txt")
    assert "caller frames cut" in why("vllm-repo55180035228-enginecore-response-mq-poll-locals.txt")


def test_trimmed_reader_takes_its_owner_from_the_role() -> None:
    (ps,) = parse_any((DUMPS / "vllm-repo55180035228-enginecore-response-mq-poll-locals.txt").read_bytes())
    e = classify(ps, role="engine_core")
    assert (e.cls, e.role) == (Cls.ENGINE_WAITING_WORKERS, "engine_core")


def test_real_pyspy_json_of_a_mimic_worker_classifies() -> None:
    ps = parse_pyspy_json(json.loads((DUMPS / "pyspy-real-mimic-worker-locals.json").read_text()))
    e = classify(ps)
    assert (e.cls, e.role, e.thread) == (Cls.IDLE_READER_WAIT, "worker", "MainThread")
    assert names(e) == ["SpinCondition.wait", "MessageQueue.acquire_read", "_GeneratorContextManager.__enter__",
                        "MessageQueue.dequeue", "WorkerProc.worker_busy_loop"]


# ------------------------------------------------------------------------------------------ vLLM 0.32 frames

HEAD = "Process {pid}: {title}\nPython v3.12.3 (/usr/bin/python3.12)\n\n"
SHM = "vllm/distributed/device_communicators/shm_broadcast.py"
MPX = "vllm/v1/executor/multiproc_executor.py"
CORE = "vllm/v1/engine/core.py"
READER = f"""    Poller.poll (zmq/sugar/poll.py:106)
    SpinCondition.wait ({SHM}:226)
    MessageQueue.acquire_read ({SHM}:731)
    _GeneratorContextManager.__enter__ (contextlib.py:137)
    MessageQueue.dequeue ({SHM}:812)
"""
WORKER_IDLE = HEAD + f"""Thread {{pid}} (idle): "MainThread"
{READER}    WorkerProc.worker_busy_loop ({MPX}:871)
    WorkerProc.worker_main ({MPX}:802)
    BaseProcess.run (multiprocessing/process.py:108)
Thread 9{{pid}} (idle): "DeathPipeMonitor"
    Connection._recv (multiprocessing/connection.py:395)
    WorkerProc.worker_main.<locals>.death_pipe_monitor ({MPX}:780)
    Thread.run (threading.py:1012)
    Thread._bootstrap_inner (threading.py:1075)
Thread 8{{pid}} (active): "WorkerAsyncOutputCopy"
    Event.synchronize (torch/cuda/streams.py:227)
    AsyncModelRunnerOutput.get_output (vllm/v1/worker/gpu_model_runner.py:190)
    WorkerProc.async_output_busy_loop ({MPX}:850)
    Thread._bootstrap_inner (threading.py:1075)
"""
FORWARD = f"""    RowParallelLinear.forward (vllm/model_executor/layers/linear.py:1422)
    Module._call_impl (torch/nn/modules/module.py:1786)
    Qwen2MLP.forward (vllm/model_executor/models/qwen2.py:101)
    Qwen2Model.forward (vllm/model_executor/models/qwen2.py:394)
    GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:2620)
    Worker.execute_model (vllm/v1/worker/gpu_worker.py:640)
    WorkerProc.worker_busy_loop ({MPX}:871)
"""
WORKER_ALL_REDUCE = HEAD + f"""Thread {{pid}} (active): "MainThread"
    _CPUSHMDistributed.all_reduce (vllm/distributed/device_communicators/cpu_communicator.py:215)
    GroupCoordinator.all_reduce (vllm/distributed/parallel_state.py:502)
    tensor_model_parallel_all_reduce (vllm/distributed/communication_op.py:14)
{FORWARD}"""
WORKER_IN_MODEL = HEAD + """Thread {pid} (active): "MainThread"
    UnquantizedLinearMethod.apply (vllm/model_executor/layers/linear.py:230)
""" + FORWARD
ENGINE_WAITING = HEAD + f"""Thread {{pid}} (idle): "MainThread"
{READER}    MultiprocExecutor.collective_rpc.<locals>.get_response ({MPX}:388)
    FutureWrapper._wait_for_response ({MPX}:96)
    FutureWrapper.result ({MPX}:90)
    EngineCore.step ({CORE}:402)
    EngineCoreProc._process_engine_step ({CORE}:1046)
    EngineCoreProc.run_busy_loop ({CORE}:1012)
Thread 7{{pid}} (idle): "Thread-1 (process_input_sockets)"
    Poller.poll (zmq/sugar/poll.py:106)
    EngineCoreProc.process_input_sockets ({CORE}:1190)
    Thread._bootstrap_inner (threading.py:1075)
"""
ENGINE_IDLE = HEAD + f"""Thread {{pid}} (idle): "MainThread"
    Condition.wait (threading.py:355)
    Queue.get (queue.py:171)
    EngineCoreProc._process_input_queue ({CORE}:1031)
    EngineCoreProc.run_busy_loop ({CORE}:1012)
"""
ENGINE_SCHEDULING = HEAD + f"""Thread {{pid}} (active): "MainThread"
    Scheduler.schedule (vllm/v1/core/sched/scheduler.py:300)
    EngineCore.step ({CORE}:395)
    EngineCoreProc._process_engine_step ({CORE}:1046)
    EngineCoreProc.run_busy_loop ({CORE}:1012)
"""
ENGINE_WRITER_BLOCKED = HEAD + f"""Thread {{pid}} (active): "MainThread"
    sched_yield (libc.so.6)
    MessageQueue.acquire_write ({SHM}:640)
    _GeneratorContextManager.__enter__ (contextlib.py:137)
    MessageQueue.enqueue ({SHM}:790)
    MultiprocExecutor.collective_rpc ({MPX}:360)
    MultiprocExecutor.execute_model ({MPX}:320)
    EngineCore.step ({CORE}:398)
"""
WORKER_OLD_SPIN = HEAD + f"""Thread {{pid}} (idle): "MainThread"
    SpinTimer.spin ({SHM}:160)
    MessageQueue.acquire_read ({SHM}:420)
    _GeneratorContextManager.__enter__ (contextlib.py:137)
    MessageQueue.dequeue ({SHM}:480)
    WorkerProc.worker_busy_loop ({MPX}:510)
"""
WORKER_REMOTE = HEAD + f"""Thread {{pid}} (idle): "MainThread"
    Socket.recv (zmq/sugar/socket.py:1000)
    MessageQueue.recv ({SHM}:830)
    MessageQueue.dequeue ({SHM}:805)
    WorkerProc.worker_busy_loop ({MPX}:871)
"""
WORKER_EAGLE = HEAD + f"""Thread {{pid}} (active): "MainThread"
    EagleProposer.propose (vllm/v1/spec_decode/eagle.py:240)
    GPUModelRunner.propose_draft_token_ids (vllm/v1/worker/gpu_model_runner.py:2800)
    GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:2620)
    WorkerProc.worker_busy_loop ({MPX}:871)
"""


def proc(template: str, pid: int, title: str, state: str | None = None) -> ProcessExplanation:
    (ps,) = parse_text(template.format(pid=pid, title=title))
    return classify(ps, proc_state=state)


def engine(template: str = ENGINE_WAITING, state: str | None = None) -> ProcessExplanation:
    return proc(template, 100, "VLLM::EngineCore", state)


def worker(template: str, tp: int, state: str | None = None) -> ProcessExplanation:
    return proc(template, 200 + tp, f"VLLM::Worker_TP{tp}", state)


def test_single_process_classes_from_reference_frames() -> None:
    cases = [
        (worker(WORKER_IDLE, 0), Cls.IDLE_READER_WAIT, "SpinCondition.wait"),
        (worker(WORKER_OLD_SPIN, 0), Cls.IDLE_READER_WAIT, "SpinTimer.spin"),
        (worker(WORKER_REMOTE, 0), Cls.IDLE_READER_WAIT, "MessageQueue.recv"),
        (worker(WORKER_ALL_REDUCE, 0), Cls.IN_COLLECTIVE, "_CPUSHMDistributed.all_reduce"),
        (worker(WORKER_IN_MODEL, 1), Cls.MODEL_FORWARD, "UnquantizedLinearMethod.apply"),
        (engine(), Cls.ENGINE_WAITING_WORKERS, "SpinCondition.wait"),
        (engine(ENGINE_IDLE), Cls.ENGINE_IDLE, "Condition.wait"),
        (engine(ENGINE_WRITER_BLOCKED), Cls.WRITER_BLOCKED_FULL_RING, "MessageQueue.acquire_write"),
        (engine(ENGINE_SCHEDULING), Cls.UNKNOWN, "Scheduler.schedule"),
    ]
    for e, cls, deciding in cases:
        assert (e.cls, e.thread) == (cls, "MainThread"), e.why
        assert deciding in names(e), names(e)
    idle = worker(WORKER_IDLE, 0)
    # the helper thread syncing with the device (WorkerAsyncOutputCopy) does not decide; the reader chain is whole
    assert names(idle) == ["Poller.poll", "SpinCondition.wait", "MessageQueue.acquire_read",
                           "_GeneratorContextManager.__enter__", "MessageQueue.dequeue", "WorkerProc.worker_busy_loop"]
    assert (idle.role, idle.rank, idle.name) == ("worker", {"TP": 0}, "Worker_TP0")
    assert names(engine())[-1] == "MultiprocExecutor.collective_rpc.<locals>.get_response"


def test_line_numbers_never_matter() -> None:
    for template in (WORKER_IDLE, WORKER_ALL_REDUCE, ENGINE_WAITING, ENGINE_WRITER_BLOCKED):
        text = template.format(pid=5, title="VLLM::Worker_TP0")
        moved = re.sub(r":\d+\)", lambda m: f":{len(m.group(0)) * 7919})", text)
        stripped = re.sub(r":\d+\)", ")", text)
        got = {classify(ps).cls for t in (text, moved, stripped) for ps in parse_text(t)}
        assert len(got) == 1


def test_titles_give_role_and_rank() -> None:
    def expl(title: str) -> ProcessExplanation:
        return classify(ProcessStack(7, title, (), "py-spy-text"))

    assert (expl("VLLM::Worker_DP1_PP0_TP2_EP3").rank) == {"DP": 1, "PP": 0, "TP": 2, "EP": 3}
    assert [expl(t).role for t in ("VLLM::EngineCore_DP1", "VLLM::Worker", "VLLM::APIServer_0", "VLLM::DPCoordinator",
                                   "sglang::scheduler_DP1_TP3", "ray::RayWorkerWrapper.execute_method")] == [
        "engine_core", "worker", "api_server", "dp_coordinator", "scheduler", "worker"]
    empty = expl("VLLM::EngineCore_DP1")
    assert (empty.cls, empty.name, empty.rank) == (Cls.UNKNOWN, "EngineCore_DP1", {"DP": 1})


# ------------------------------------------------------------------------------------------ across ranks


def test_sigstopped_tp1_is_the_culprit_and_poll_parking_is_contradicted() -> None:
    # Measured on vLLM 0.32 CPU, TP=2 (reference §5): TP0 spins in all_reduce, EngineCore waits in get_response,
    # TP1 is in state T (its frames come from py-spy --nonblocking).
    expls = [engine(), worker(WORKER_ALL_REDUCE, 0), worker(WORKER_IN_MODEL, 1, state="T")]
    assert [e.cls for e in expls] == [Cls.ENGINE_WAITING_WORKERS, Cls.IN_COLLECTIVE, Cls.STOPPED]
    v = cross_rank(expls)
    assert v.culprit == "Worker_TP1"
    assert "stopped" in v.reason and "Worker_TP0 in_collective" in v.reason
    assert v.frames[0].function == "UnquantizedLinearMethod.apply"
    h = poll_parking(expls, work_pending=True, stacks_changed=False)
    assert h.status is Status.CONTRADICTED and "Worker_TP0" in h.reason
    assert h.frames[0].function == "_CPUSHMDistributed.all_reduce"


def test_without_the_stopped_rank_state_the_idle_or_busy_peer_is_blamed() -> None:
    busy = cross_rank([engine(), worker(WORKER_ALL_REDUCE, 0), worker(WORKER_IN_MODEL, 1)])
    assert busy.culprit == "Worker_TP1" and "wait in a collective for it" in busy.reason
    idle = cross_rank([engine(), worker(WORKER_ALL_REDUCE, 0), worker(WORKER_IDLE, 1)])
    assert idle.culprit == "Worker_TP1" and "only looks idle" in idle.reason
    missing = cross_rank([engine(), worker(WORKER_ALL_REDUCE, 0)])  # plain py-spy fails on a stopped process
    assert missing.culprit is None and "missing from the dump" in missing.reason


def test_enginecore_stopped_or_blocked_with_idle_workers() -> None:
    workers = [worker(WORKER_IDLE, 0), worker(WORKER_IDLE, 1)]
    stopped = cross_rank([engine(ENGINE_IDLE, state="T"), *workers])
    assert stopped.culprit == "EngineCore" and "stopped" in stopped.reason
    assert poll_parking([engine(ENGINE_IDLE, state="T"), *workers], True, False).status is Status.CONTRADICTED
    blocked = cross_rank([engine(ENGINE_SCHEDULING), *workers])
    assert blocked.culprit == "EngineCore" and "never sends" in blocked.reason
    assert blocked.frames[0].function == "Scheduler.schedule"
    h = poll_parking([engine(ENGINE_SCHEDULING), *workers], True, False)
    assert h.status is Status.INCONCLUSIVE and "EngineCore is unknown" in h.reason


def test_all_idle_has_no_culprit_and_poll_parking_does_not_apply() -> None:
    expls = [engine(ENGINE_IDLE), worker(WORKER_IDLE, 0), worker(WORKER_IDLE, 1)]
    v = cross_rank(expls)
    assert v.culprit is None and "idle" in v.reason
    assert poll_parking(expls, work_pending=False, stacks_changed=False).status is Status.NOT_APPLICABLE
    # work pending yet EngineCore idle in its input queue: the work is stuck elsewhere, not in the ring
    assert poll_parking(expls, work_pending=True, stacks_changed=False).status is Status.CONTRADICTED


def test_poll_parking_signature_is_supported() -> None:
    expls = [engine(), worker(WORKER_IDLE, 0), worker(WORKER_REMOTE, 1)]
    h = poll_parking(expls, work_pending=True, stacks_changed=False)
    assert h.status is Status.SUPPORTED, h.reason
    assert [f.function for f in h.frames][:2] == ["Poller.poll", "SpinCondition.wait"]
    assert h.spec_frames == ()
    assert cross_rank(expls).culprit is None and "lost wake-up" in cross_rank(expls).reason
    writer = poll_parking([engine(ENGINE_WRITER_BLOCKED), *expls[1:]], True, False)
    assert writer.status is Status.SUPPORTED
    assert poll_parking(expls, True, stacks_changed=True).status is Status.CONTRADICTED


def test_poll_parking_inconclusive_names_what_is_missing() -> None:
    h = poll_parking([worker(WORKER_IDLE, 0), worker(WORKER_IDLE, 1)], work_pending=None, stacks_changed=None)
    assert h.status is Status.INCONCLUSIVE
    for missing in ("no EngineCore stack", "work state unknown", "single capture"):
        assert missing in h.reason
    h = poll_parking([engine()], work_pending=True, stacks_changed=False)
    assert h.status is Status.INCONCLUSIVE and "no worker stacks" in h.reason


def test_slow_rank_and_moved_stacks() -> None:
    expls = [engine(), worker(WORKER_IDLE, 0), worker(WORKER_IN_MODEL, 1)]
    v = cross_rank(expls)
    assert v.culprit == "Worker_TP1" and "has not finished its step" in v.reason
    slow = cross_rank(expls, moved={"Worker_TP1": True})
    assert slow.culprit == "Worker_TP1" and "slow rather than frozen" in slow.reason


def test_spec_decode_frames_are_reported_as_the_rival_hypothesis() -> None:
    eagle = worker(WORKER_EAGLE, 1)
    assert (eagle.cls, eagle.spec_decode) == (Cls.MODEL_FORWARD, True)
    assert eagle.spec_frames[0].function == "EagleProposer.propose"
    h = poll_parking([engine(), worker(WORKER_IDLE, 0), eagle], work_pending=True, stacks_changed=False)
    assert h.status is Status.CONTRADICTED and "rival hypothesis" in h.reason
    assert h.spec_frames[0].function == "EagleProposer.propose"
    assert not worker(WORKER_IDLE, 0).spec_decode


def test_empty_inputs_are_handled() -> None:
    assert cross_rank([]).culprit is None
    assert poll_parking([], None, None).status is Status.INCONCLUSIVE
    e = classify(ProcessStack(None, "", (), "py-spy-text"), proc_state="T")
    assert (e.cls, e.frames, e.thread) == (Cls.STOPPED, (), "no thread")


def test_native_frames_inside_a_wait_keep_the_class() -> None:
    native_idle = ENGINE_IDLE.replace('"MainThread"\n', '"MainThread"\n    0x7f1 (libc.so.6)\n'
                                      "    pthread_cond_timedwait (libc.so.6)\n"
                                      "    PyThread_acquire_lock_timed (python3.12)\n")
    e = engine(native_idle)
    assert e.cls is Cls.ENGINE_IDLE
    assert names(e)[-2:] == ["EngineCoreProc._process_input_queue", "EngineCoreProc.run_busy_loop"]
    # a queue.get under _process_input_queue that is busy handling a message is not idle
    busy = ENGINE_IDLE.replace("    Condition.wait (threading.py:355)\n    Queue.get (queue.py:171)\n",
                               "    EngineCore.add_request (vllm/v1/engine/core.py:250)\n")
    assert busy != ENGINE_IDLE
    assert engine(busy).cls is Cls.UNKNOWN
