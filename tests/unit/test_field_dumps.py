"""The dump forms people paste into issues, read and classified: tracebacks, Flight Recorder and gdb frames, kernel
stacks, fragments, faulthandler with a crashing thread that is not the main one, and vLLM 0.33 / SGLang frames.

Values asserted on corpus files are read off the files themselves (see each file's header); the hand labels are
checked in test_explain.py::test_corpus_classification. Stacks written inline are shaped after the field dumps
named beside them and say so.
"""

from __future__ import annotations

from pathlib import Path

from tests.facts import says
from watchdog.evidence.explain.classes import Cls
from watchdog.evidence.explain.ranks import ProcessExplanation, classify
from watchdog.evidence.stacks.parse import Frame, ProcessStack, parse_any, parse_text

DUMPS = Path(__file__).resolve().parents[1] / "data" / "dumps"


def load(name: str) -> list[ProcessStack]:
    return parse_any((DUMPS / name).read_bytes())


def funcs(ps: ProcessStack, thread: int = 0) -> list[str]:
    return [f.function for f in ps.threads[thread].frames]


def explain(text: str) -> ProcessExplanation:
    (ps,) = parse_text(text)
    return classify(ps)


# ------------------------------------------------------------------------------------------ tracebacks


def test_chained_traceback_is_joined_to_its_cause_innermost_first() -> None:
    (ps,) = load("vllm-19197-enginecore-traceback-rpc-timeout-in-acquire-read.txt")
    assert ps.source == "traceback" and len(ps.threads) == 1
    assert funcs(ps)[:5] == ["acquire_read", "__enter__", "dequeue", "get_response", "collective_rpc"]
    assert funcs(ps)[-4:] == ["step", "_process_engine_step", "run_busy_loop", "run_engine_core"]
    assert ps.threads[0].frames[0].line == 427  # the cause's innermost frame, not the re-raise in collective_rpc
    e = classify(ps)
    assert (e.cls, e.role) == (Cls.ENGINE_WAITING_WORKERS, "engine_core")  # a reader under get_response: not idle


def test_log_prefixed_traceback_with_a_process_prefix() -> None:
    (ps,) = load("vllm-12625-worker-v0-traceback-ncclAllReduce-error.txt")
    assert (ps.pid, ps.title) == (350, "VllmWorkerProcess")
    assert funcs(ps)[:3] == ["NCCL_CHECK", "ncclAllReduce", "all_reduce"]
    assert funcs(ps)[-1] == "_run_worker_process"  # "direct cause" joined at _wrapper


def test_keyboardinterrupt_traceback_and_the_p2p_probe_is_no_collective() -> None:
    (ps,) = load("vllm-8735-p2p-probe-subprocess-keyboardinterrupt-traceback.txt")
    assert ps.threads[0].frames[0] == Frame(
        "poll", "/home/data/miniconda/envs/llm/lib/python3.11/multiprocessing/popen_fork.py", 27)
    assert classify(ps).cls is Cls.UNKNOWN  # custom_all_reduce_utils.py waits for a child, it runs no all-reduce


def test_headerless_traceback_fragment_with_elided_paths() -> None:
    (ps,) = load("vllm-35104-fragment-traceback-spin-condition-timeout.txt")
    assert ps.threads[0].frames == (Frame("timeout_ms", ".../shm_broadcast.py", 632),
                                    Frame("acquire_read", ".../shm_broadcast.py", 675),
                                    Frame("dequeue", ".../shm_broadcast.py", 756))


def test_chained_tracebacks_that_do_not_meet_stay_apart() -> None:
    text = ('Traceback (most recent call last):\n  File "a.py", line 1, in f\nValueError: x\n\n'
            "During handling of the above exception, another exception occurred:\n\n"
            'Traceback (most recent call last):\n  File "b.py", line 2, in g\n  File "b.py", line 3, in h\n'
            "RuntimeError: y\n")
    (ps,) = parse_text(text)
    assert [[f.function for f in t.frames] for t in ps.threads] == [["f"], ["h", "g"]]


# ------------------------------------------------------------------------------------------ faulthandler


def test_crashing_thread_that_decides_is_named() -> None:
    (ps,) = load("sglang-3745-scheduler-faulthandler-crash-in-forward-thread-all-reduce.txt")
    current = [t for t in ps.threads if t.current]
    assert [t.thread_id for t in current] == ["0x00007f2ea0870640"]
    e = classify(ps)
    assert e.cls is Cls.IN_COLLECTIVE and e.thread == "thread 0x00007f2ea0870640"
    assert says(e.why, "main thread", "waits", "forward thread")
    assert says(e.crashed, "crashing thread", "0x00007f2ea0870640"), e.crashed


def test_crashing_thread_is_described_when_the_main_thread_is_missing() -> None:
    (ps,) = load("sglang-3658-quoted-faulthandler-forward-thread-only.txt")  # a "> " quote of the dump
    assert [t.thread_id for t in ps.threads] == ["0x00007f2fe8afc640", "0x00007f1f035fe640"]
    e = classify(ps)
    assert e.cls is Cls.UNKNOWN and "no main thread" in e.why
    assert "forward_thread_func" in e.crashed and e.crashed in e.why


def test_crashing_helper_thread_does_not_decide_but_is_said() -> None:
    # Shaped after the sglang faulthandler dumps: main thread in the model, a second thread crashed in a sync.
    e = explain('Fatal Python error: Segmentation fault\n\n'
                'Current thread 0x00007f00 (most recent call first):\n'
                '  File "/x/torch/cuda/streams.py", line 224 in synchronize\n'
                '  File "/x/vllm/v1/worker/gpu/async_utils.py", line 80 in get_output\n'
                '  File "/usr/lib/python3.12/threading.py", line 1012 in run\n'
                '  File "/usr/lib/python3.12/threading.py", line 1075 in _bootstrap_inner\n\n'
                'Thread 0x00007f01 (most recent call first):\n'
                '  File "/x/vllm/model_executor/models/llama.py", line 300 in forward\n'
                '  File "/x/vllm/v1/worker/gpu/model_runner.py", line 900 in execute_model\n'
                '  File "<string>", line 1 in <module>\n')
    assert (e.cls, e.thread) == (Cls.MODEL_FORWARD, "thread 0x00007f01")
    assert says(e.crashed, "crashing thread", "0x00007f00", "device", "synchronize (streams.py)"), e.crashed


# ------------------------------------------------------------------------------------------ numbered frames


def test_flight_recorder_stack() -> None:
    (ps,) = load("torch-flight-recorder-60331145948-rank3-all-reduce-warmup.txt")
    frames = ps.threads[0].frames
    assert ps.source == "numbered" and len(frames) == 20
    assert frames[0] == Frame("all_reduce", "/usr/local/lib/python3.12/dist-packages/torch/distributed/"
                                            "distributed_c10d.py", 3174)
    assert frames[18] == Frame("_run_code", "<frozen runpy>", 88)
    assert classify(ps).cls is Cls.IN_COLLECTIVE


def test_gdb_backtrace() -> None:
    (ps,) = load("pytorch-95944-gdb-cudaMemcpyAsync-local-scalar-dense.txt")
    frames = ps.threads[0].frames
    assert len(frames) == 16 and frames[0] == Frame("??", "/lib64/libcuda.so.1", None, native=True)
    assert frames[14].function == "cudaMemcpyAsync" and frames[14].native
    e = classify(ps)
    assert e.cls is Cls.DEVICE_WAIT and e.frames[0].function == "cudaMemcpyAsync"
    assert e.frames[1].function.startswith("at::native::_local_scalar_dense_cuda")  # the frame that decides


def test_gdb_threads_are_separate() -> None:
    (ps,) = parse_text('Thread 2 (Thread 0x7fc5 (LWP 3913153) "executor_server"):\n'
                       "#0  0x00007fc5b129cac1 in poll () from /lib64/libc.so.6\n"
                       "#1  0x00007fc5b3958e4f in ?? () from /lib64/libcuda.so.1\n"
                       'Thread 1 (Thread 0x7fc6 (LWP 3913100) "python"):\n'
                       "#0  0x00007f in cuEventSynchronize () from /lib64/libcuda.so.1\n")
    assert [(t.thread_id, t.name, len(t.frames)) for t in ps.threads] == [("3913153", "executor_server", 2),
                                                                           ("3913100", "python", 1)]


# ------------------------------------------------------------------------------------------ kernel stacks


def test_proc_pid_stack_in_a_driver_spin() -> None:
    (ps,) = load("pytorch-nvidia-ogkm-456-proc-stack-uvm-spin-loop.txt")
    frames = ps.threads[0].frames
    assert ps.source == "kernel" and len(frames) == 14
    assert frames[0] == Frame("uvm_spin_loop", "nvidia_uvm", None, native=True)
    e = classify(ps)
    assert e.cls is Cls.DEVICE_WAIT
    assert says(e.why, "kernel stack", "no Python frame", "nvidia_uvm"), e.why


def test_hung_task_call_trace_drops_unreliable_frames() -> None:
    (ps,) = load("pytorch-returnn-1480-dmesg-hung-task-uvm-ioctl.txt")
    assert (ps.pid, ps.title) == (15277, "python3.11")
    assert len(ps.threads[0].frames) == 13  # the 17 lines of frames less the 4 marked "?" before uvm_ioctl
    assert ps.threads[0].frames[-1] == Frame("uvm_ioctl", "nvidia_uvm", None, native=True)


def test_hidden_address_kernel_stack_without_a_driver() -> None:
    (ps,) = load("other-golang-42242-proc-stack-futex-wait.txt")
    assert [f.file for f in ps.threads[0].frames] == ["kernel"] * 6
    e = classify(ps)
    assert e.cls is Cls.UNKNOWN and "Kernel stack only" in e.why and "driver" not in e.why


# ------------------------------------------------------------------------------------------ fragments


def test_unindented_pyspy_fragment_with_an_annotation() -> None:
    (ps,) = load("vllm-pr52814-fragment-pyspy-reader-busy-wait.txt")
    assert ps.threads[0].frames == (Frame("sched_yield", "vllm/distributed/utils.py", 48),
                                    Frame("wait", "shm_broadcast.py", 203), Frame("acquire_read", "shm_broadcast.py",
                                                                                  None))
    e = classify(ps)
    assert e.cls is Cls.IDLE_READER_WAIT and "caller frames cut" in e.why


def test_pasted_pyspy_native_with_placeholders_fences_and_elisions() -> None:
    # The shape of vllm#42897's paste: prose, a fence, "Thread <pid>", wide native columns, "..." for cut frames.
    e = explain("`py-spy dump --pid <EngineCore-pid> --native` consistently shows:\n\n```\n"
                'Thread <pid> (active): "MainThread"\n'
                "    cuEventSynchronize                                       (libcuda.so.595.45.04)\n"
                "    cudaEventSynchronize                                     (libcudart.so.13)\n"
                "    ...\n"
                "    _to_list                                        (vllm/v1/worker/gpu_model_runner.py:2400)\n"
                "    sample_tokens                                   (vllm/v1/worker/gpu_model_runner.py:3100)\n"
                "```\n")
    assert (e.cls, e.thread) == (Cls.DEVICE_WAIT, "MainThread")
    assert [f.function for f in e.frames][:2] == ["cuEventSynchronize", "cudaEventSynchronize"]


def test_two_line_native_compile_fragment() -> None:
    e = explain("stuck here for minutes:\n    llvm::Module::print (libtriton.so)\n"
                "    translateLLVMIRToASM (libtriton.so)\n")
    assert e.cls is Cls.COMPILE


# ------------------------------------------------------------------------------------------ engine frames


SHM = "vllm/distributed/device_communicators/shm_broadcast.py"
MPX = "vllm/v1/executor/multiproc_executor.py"


def test_vllm_033_enginecore_waiting_on_the_sample_tokens_rpc() -> None:
    e = explain('Process 9: VLLM::EngineCore\nPython v3.12.3 (/usr/bin/python3.12)\n\nThread 9 (idle): "MainThread"\n'
                f"    Poller.poll (zmq/sugar/poll.py:106)\n    SpinCondition.wait ({SHM}:226)\n"
                f"    MessageQueue.acquire_read ({SHM}:731)\n    MessageQueue.dequeue ({SHM}:812)\n"
                f"    MultiprocExecutor.collective_rpc.<locals>.get_response ({MPX}:388)\n"
                f"    MultiprocExecutor.collective_rpc ({MPX}:360)\n    MultiprocExecutor.sample_tokens ({MPX}:330)\n"
                "    EngineCore.step_with_batch_queue (vllm/v1/engine/core.py:420)\n")
    assert e.cls is Cls.ENGINE_WAITING_WORKERS


def test_vllm_033_async_output_copy_and_v2_model_runner() -> None:
    uniproc = explain('Thread 9 (active): "MainThread"\n    Event.synchronize (torch/cuda/streams.py:224)\n'
                      "    AsyncOutput.get_output (vllm/v1/worker/gpu/async_utils.py:80)\n"
                      "    AsyncOutputFuture.result (vllm/v1/executor/uniproc_executor.py:40)\n"
                      "    EngineCore.step_with_batch_queue (vllm/v1/engine/core.py:420)\n")
    assert uniproc.cls is Cls.DEVICE_WAIT
    cut = explain('Thread 9 (active): "MainThread"\n    AsyncModelRunnerOutput.get_output '
                  "(vllm/v1/worker/gpu_model_runner.py:190)\n    WorkerProc.worker_busy_loop "
                  f"({MPX}:871)\n")
    assert cut.cls is Cls.DEVICE_WAIT  # the synchronize frame itself is C in some builds
    v2 = explain('Thread 9 (active): "MainThread"\n'
                 "    GPUModelRunner.sample_tokens (vllm/v1/worker/gpu/model_runner.py:1862)\n"
                 "    Worker.sample_tokens (vllm/v1/worker/gpu_worker.py:1105)\n"
                 f"    WorkerProc.worker_busy_loop ({MPX}:871)\n")
    assert v2.cls is Cls.MODEL_FORWARD


def test_sglang_resolve_last_batch_result_waits_for_its_forward_thread() -> None:
    main = ('Thread 1 (idle): "MainThread"\n    wait (threading.py:359)\n    wait (threading.py:655)\n'
            "    resolve_last_batch_result (managers/tp_worker_overlap_thread.py:200)\n"
            "    event_loop_overlap (managers/scheduler.py:900)\n")
    alone = explain(main)
    assert alone.cls is Cls.UNKNOWN and says(alone.why, "waits", "forward thread"), alone.why
    both = explain(main + 'Thread 2 (active): "Thread-3 (forward_thread_func)"\n'
                   "    forward_extend (model_executor/model_runner.py:1800)\n"
                   "    forward_thread_func_ (managers/tp_worker_overlap_thread.py:140)\n"
                   "    forward_thread_func (managers/tp_worker_overlap_thread.py:109)\n    run (threading.py:1012)\n")
    assert (both.cls, both.thread) == (Cls.MODEL_FORWARD, "Thread-3 (forward_thread_func)")
    idle_fwd = explain(main + 'Thread 2 (idle): "Thread-3 (forward_thread_func)"\n    wait (threading.py:320)\n'
                       "    get (queue.py:171)\n    forward_thread_func_ (managers/tp_worker_overlap_thread.py:130)\n")
    assert idle_fwd.cls is Cls.UNKNOWN  # the forward thread's loop waiting for work is no model forward
