"""Classification of every corpus dump, and cross-rank verdicts on stacks built from the frames seen on vLLM 0.32."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.facts import clause_of, says
from watchdog.core.roles import Role
from watchdog.evidence.explain.classes import Cls, Status
from watchdog.evidence.explain.ranks import ProcessExplanation, classify, cross_rank, poll_parking
from watchdog.evidence.stacks.parse import ProcessStack, parse_any, parse_pyspy_json, parse_text

DUMPS = Path(__file__).resolve().parents[1] / "data" / "dumps"


def names(e: ProcessExplanation) -> list[str]:
    return [f.function for f in e.frames]


# ------------------------------------------------------------------------------------------ the corpus

# The hand labels and the one table mapping a hand class onto Cls are in tests/data/dumps/LABELS.md.
LABELS = DUMPS / "LABELS.md"


def table(section: str) -> list[list[str]]:
    """The rows of the markdown table under `## section` in LABELS.md (header and rule left out)."""
    text = LABELS.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip().strip("|") for line in text.splitlines() if line.startswith("|")]
    rows = [[c.strip() for c in line.split("|")] for line in lines]
    return rows[2:]


HAND_TO_CLS = {hand: Cls(cls) for hand, cls, _ in table("Hand class to classifier class")}
HAND = {row[0]: row[1] for row in table("Files")}

# Documented disagreements: file -> (what the classifier says, None for "no process read", and why the hand label
# cannot be reached from the dump alone). Each must still disagree; a fixed one leaves the list.
EXCEPTIONS: dict[str, tuple[Cls | None, str]] = {
    "vllm-lmcache-4759-enginecore-background-threads-idle.txt": (
        Cls.UNKNOWN, "the excerpt holds only the <module> frame of MainThread plus helper threads; 'idle' is the "
                     "poster's prose"),
    "vllm-repo55180035228-enginecore-response-mq-poll-locals.txt": (
        Cls.IDLE_READER_WAIT, "every frame above dequeue is cut and no title says EngineCore: nothing shows whose "
                              "queue it is (given the role it is engine_waiting_workers, tested below)"),
    "vllm-35104-fragment-traceback-spin-condition-timeout.txt": (
        Cls.IDLE_READER_WAIT, "a three-frame fragment without its owner frame; only the comment around it says "
                              "EngineCore"),
    "gpu-pyspy-wedged.txt": (
        Cls.UNKNOWN, "without --native the device sync is a C call: no Python frame shows it (the --native dump "
                     "of the same process is device_wait)"),
    "vllm-pr41834-worker-tp0-gdb-cuStreamSynchronize-item.txt": (
        None, "a hand-condensed gdb backtrace ('a → b → c') is no format we read: explain says so"),
}
EXPECTED_EXCEPTIONS = 5  # raise only with a new entry above and its reason


def labelled(name: str) -> ProcessExplanation | None:
    """The process a file's hand label is about: the last one (earlier ones are tails of other ranks' dumps)."""
    stacks = parse_any((DUMPS / name).read_bytes())
    return classify(stacks[-1]) if stacks else None


def test_every_corpus_file_has_a_hand_label_that_maps() -> None:
    assert sorted(HAND) == sorted(p.name for p in DUMPS.iterdir() if p.suffix in (".txt", ".json"))
    assert set(HAND.values()) <= set(HAND_TO_CLS), set(HAND.values()) - set(HAND_TO_CLS)
    assert len(HAND) >= 45


def test_exceptions_do_not_grow_silently() -> None:
    assert len(EXCEPTIONS) == EXPECTED_EXCEPTIONS
    assert set(EXCEPTIONS) <= set(HAND)
    assert len(EXCEPTIONS) * 8 <= len(HAND)  # at most one file in eight may disagree


@pytest.mark.parametrize("name", sorted(HAND))
def test_corpus_classification(name: str) -> None:
    expected = HAND_TO_CLS[HAND[name]]
    e = labelled(name)
    got = e.cls if e is not None else None
    if name in EXCEPTIONS:
        assert got == EXCEPTIONS[name][0] and got != expected, f"{name}: exception no longer holds: {got}"
    else:
        assert got == expected, f"{name}: hand {HAND[name]} -> {expected}, classifier {got}: {e and e.why}"
    for ps in parse_any((DUMPS / name).read_bytes()):
        why = classify(ps).why
        assert why.endswith(".") and classify(ps).name in why


def test_why_sentences_say_what_matters() -> None:
    def why(name: str) -> str:
        return classify(parse_any((DUMPS / name).read_bytes())[-1]).why

    assert "shutting down" in why("sglang-31178-scheduler-tp6-threading-shutdown-native.txt")
    assert "during startup" in why("vllm-17676-enginecore-flashinfer-sampling-warmup.txt")
    assert "during startup" in why("vllm-15687-ray-worker-ncclCommInitRank-faulthandler.txt")
    assert says(why("sglang-4257-tp0-forward-thread-flashinfer-prefill.txt"), "main thread", "waits", "forward thread")
    assert "Speculative-decoding frames" in why("sglang-6891-scheduler-dp1-tp3-eagle-draft.txt")
    assert "caller frames cut" in why("vllm-repo55180035228-enginecore-response-mq-poll-locals.txt")


def test_trimmed_reader_takes_its_owner_from_the_role() -> None:
    (ps,) = parse_any((DUMPS / "vllm-repo55180035228-enginecore-response-mq-poll-locals.txt").read_bytes())
    e = classify(ps, role=Role.ENGINE_CORE)
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
        (engine(ENGINE_SCHEDULING), Cls.ENGINE_LOOP, "Scheduler.schedule"),  # its own loop: moving there is not work
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
    assert busy.culprit == "Worker_TP1" and says(clause_of(busy.reason, "Worker_TP0"), "collective"), busy.reason
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
    assert h.status is Status.INCONCLUSIVE and "EngineCore is engine_loop" in h.reason


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
    assert v.culprit == "Worker_TP1" and says(v.reason, "Worker_TP1", "model_forward", "not finished"), v.reason
    slow = cross_rank(expls, moved={"Worker_TP1": True})
    assert slow.culprit == "Worker_TP1" and says(slow.reason, "moved", "slow"), slow.reason


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
    assert engine(busy).cls is Cls.ENGINE_LOOP  # handling input in its own loop, not waiting for it
