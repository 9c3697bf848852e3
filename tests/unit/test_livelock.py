"""Moving is not working (issue 11 part 2): stacks that move only inside EngineCore's own loop, burning CPU while the
page shows no progress, are a livelock; requests waiting while none runs, with nothing in the model, an admission
stall. Both confirm the freeze; movement in the model (a long step) still clears it.

Captures are built from vLLM 0.32 frames (the builders of test_evidence_bundle); the public report this guards
against: FujitsuPolycom/sparkring#200 (EngineCore live-looping at 100 % CPU for 33 minutes with 0 running, 3 waiting,
the KV pool pinned, /health 200).
"""

from __future__ import annotations

from dataclasses import replace

from tests.facts import clause_of, says
from tests.unit.test_evidence_bundle import (
    API,
    API_FRAMES,
    CORE,
    ENGINE,
    ENGINE_WAITING,
    MPX,
    READER,
    SHM,
    SITE,
    STDLIB,
    TP0,
    TP1,
    WORKER_FORWARD,
    WORKER_IDLE,
    Frames,
    Round,
    by_pid,
    capture,
)
from watchdog.core.processes import Capture
from watchdog.core.types import Decision
from watchdog.evidence.explain.classes import Cls
from watchdog.evidence.explain.findings import PageWork, StuckKind, assess

SCHED = f"{SITE}/vllm/v1/core/sched/scheduler.py"
LOOP_TAIL: Frames = [("EngineCoreProc._process_engine_step", CORE, 1606), ("EngineCoreProc.run_busy_loop", CORE, 1012),
                     ("EngineCoreProc.run_engine_core", CORE, 850)]
# EngineCore inside its loop, as py-spy shows it between the steps of an engine that schedules nothing.
SCHEDULING: Frames = [("KVCacheManager.allocate_slots", f"{SITE}/vllm/v1/core/kv_cache_manager.py", 240),
                      ("Scheduler.schedule", SCHED, 778), ("EngineCore.step", CORE, 667), *LOOP_TAIL]
UPDATING: Frames = [("Scheduler.make_stats", SCHED, 2940), ("Scheduler.update_from_output", SCHED, 1520),
                    ("EngineCore.step", CORE, 681), *LOOP_TAIL]
ENGINE_IDLE: Frames = [("Condition.wait", f"{STDLIB}/threading.py", 355), ("Queue.get", f"{STDLIB}/queue.py", 171),
                       ("EngineCoreProc._process_input_queue", CORE, 1031),
                       ("EngineCoreProc.run_busy_loop", CORE, 1012)]
# A worker handed an empty step: execute_model returns at once, no model layer under it.
EMPTY_STEP: Frames = [("CPUModelRunner.execute_model", f"{SITE}/vllm/v1/worker/gpu_model_runner.py", 2410),
                      ("CPUWorker.execute_model", f"{SITE}/vllm/v1/worker/cpu_worker.py", 180),
                      ("WorkerProc.worker_busy_loop", MPX, 812), ("WorkerProc.worker_main", MPX, 707)]
# The output rank (TP0: the executor asks only it to reply) handing its empty step's result back to EngineCore:
# WorkerProc._execute_worker_rpc > handle_output > enqueue_output > MessageQueue.enqueue (vLLM 0.32,
# multiproc_executor.py 1058/1018/1008), pickling the result, or waiting for a slot of its response ring.
WORKER_REPLY: Frames = [("MessageQueue.enqueue", SHM, 925), ("WorkerProc.enqueue_output", MPX, 1008),
                        ("WorkerProc.handle_output", MPX, 1018), ("WorkerProc._execute_worker_rpc", MPX, 1058),
                        ("WorkerProc.worker_busy_loop", MPX, 1041), ("WorkerProc.worker_main", MPX, 944)]
WORKER_REPLY_SLOT: Frames = [("MessageQueue.acquire_write", SHM, 740),
                             ("_GeneratorContextManager.__enter__", f"{STDLIB}/contextlib.py", 137), *WORKER_REPLY]
STALL = PageWork(running=0, waiting=3)  # the report's page


def rnd(engine: Frames, engine_cpu: float, tp0: Frames = WORKER_IDLE, tp1: Frames = WORKER_IDLE,
        worker_cpu: float = 20.0) -> Round:
    return {API.pid: (API_FRAMES, "S", 1.0), ENGINE.pid: (engine, "R", engine_cpu),
            TP0.pid: (tp0, "S", worker_cpu), TP1.pid: (tp1, "S", worker_cpu)}


def test_movement_in_the_engine_loop_burning_cpu_is_a_livelock() -> None:
    cap = capture(rnd(SCHEDULING, 5.0), rnd(UPDATING, 7.7))  # 2.7 CPU s in a 3 s gap
    for page in (PageWork(running=2, waiting=0), None):  # CPU and stacks alone decide; the page adds words
        f = assess(cap, work_pending=True, page=page)
        assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LIVELOCK, f.reason
        assert says(f.reason, "livelock", "EngineCore", "engine_loop", "2.7", "3 s", "moved"), f.reason
        assert [p.process.pid for p in f.processes if p.moved] == [ENGINE.pid]  # only EngineCore moved
    # the page's stall says why the loop turns empty (the real vLLM 0.32 burns CPU stepping empty batches there too)
    f = assess(cap, True, STALL)
    assert f.stuck_kind is StuckKind.ADMISSION_STALL, f.reason
    assert says(f.reason, "running=0", "waiting=3", "EngineCore", "engine_loop", "2.7"), f.reason
    p = by_pid(assess(cap, True, STALL))
    assert p[ENGINE.pid].explanation.cls is Cls.ENGINE_LOOP and p[ENGINE.pid].last_cls is Cls.ENGINE_LOOP
    assert p[ENGINE.pid].moved is True and p[ENGINE.pid].gap == 3.0


def test_a_livelock_whose_steps_reach_the_workers_empty_is_still_a_livelock() -> None:
    """Each turn broadcasts an empty step: EngineCore waits on the replies, a worker passes through execute_model."""
    cap = capture(rnd(SCHEDULING, 5.0), rnd(ENGINE_WAITING, 7.0, tp0=EMPTY_STEP))
    f = assess(cap, work_pending=True, page=STALL)  # with the stalled page: an admission stall, the loop burning
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.ADMISSION_STALL, f.reason
    assert says(f.reason, "EngineCore", "engine_loop"), f.reason
    assert by_pid(f)[TP0.pid].last_cls is Cls.MODEL_FORWARD  # seen there once: an empty step passing through
    # without the page's word that nothing runs, a rank seen in execute_model is taken for a long step (as before)
    assert assess(cap, work_pending=True, page=None).decision is Decision.WORKING


def test_an_admission_stall_whose_output_rank_hands_back_empty_steps_is_still_an_admission_stall() -> None:
    """Seen live on vLLM 0.32 (CPU, TP=2, a clean CI run): with running=0, waiting=1 on the page, the stacks said
    "stacks moved between captures (Worker_TP0)" and held the engine `working` for 2 minutes. TP0 is the output rank:
    after each empty step it writes the reply into its response ring (writer_blocked_full_ring), then reads the next
    step (its reader) or runs the next empty execute_model. That is the empty step's handoff, not work."""
    for first, last in ((WORKER_IDLE, WORKER_REPLY), (WORKER_REPLY_SLOT, WORKER_IDLE), (EMPTY_STEP, WORKER_REPLY),
                        (WORKER_REPLY, EMPTY_STEP)):
        cap = capture(rnd(ENGINE_WAITING, 5.0, tp0=first), rnd(SCHEDULING, 7.0, tp0=last))
        f = assess(cap, work_pending=True, page=STALL)
        assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.ADMISSION_STALL, f.reason
        assert Cls.WRITER_BLOCKED_FULL_RING in {by_pid(f)[TP0.pid].explanation.cls, by_pid(f)[TP0.pid].last_cls}
        assert says(clause_of(f.reason, "moved"), "EngineCore", "Worker_TP0"), f.reason
    # EngineCore caught broadcasting an empty step at one capture, a worker in the empty execute_model: the same stall
    f = assess(capture(rnd(WRITER, 5.0), rnd(UPDATING, 7.0, tp0=EMPTY_STEP)), work_pending=True, page=STALL)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.ADMISSION_STALL, f.reason
    # a rank in the model at both captures is still a step, whatever the page says
    cap = capture(rnd(ENGINE_WAITING, 5.0, tp0=WORKER_REPLY, tp1=WORKER_FORWARD),
                  rnd(ENGINE_WAITING, 5.1, tp0=WORKER_IDLE, tp1=WORKER_FORWARD))
    assert assess(cap, work_pending=True, page=STALL).decision is Decision.WORKING


def test_movement_in_the_model_forward_is_still_a_long_step() -> None:
    cap = capture(rnd(ENGINE_WAITING, 5.0, tp0=WORKER_FORWARD, tp1=WORKER_FORWARD, worker_cpu=20.0),
                  rnd(ENGINE_WAITING, 5.1, tp0=WORKER_FORWARD[1:], tp1=WORKER_FORWARD, worker_cpu=23.0))
    for page in (PageWork(running=1, waiting=0), STALL, None):  # in the model at both captures: a step, whatever
        f = assess(cap, work_pending=True, page=page)
        assert f.decision is Decision.WORKING and f.stuck_kind is None
        assert says(f.reason, "Worker_TP0", "model_forward", "long step"), f.reason


def test_running_zero_waiting_nothing_moving_is_an_admission_stall() -> None:
    cap = capture(rnd(ENGINE_IDLE, 5.0), rnd(ENGINE_IDLE, 5.0))
    f = assess(cap, work_pending=True, page=STALL)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.ADMISSION_STALL
    assert says(f.reason, "admission stall", "running=0", "waiting=3"), f.reason
    # the same stacks with nothing waiting are parked ranks (a wedge the probe found), not an admission stall
    f = assess(cap, work_pending=True, page=PageWork(running=0, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED
    # and with no work pending at all (`watchdog dump` of a healthy engine): idle, not stuck
    f = assess(cap, work_pending=False, page=PageWork(running=0, waiting=0))
    assert f.decision is Decision.IDLE and f.stuck_kind is None, f.reason


def test_a_stall_with_the_loop_turning_slowly_is_an_admission_stall() -> None:
    cap = capture(rnd(SCHEDULING, 5.0), rnd(UPDATING, 5.2))  # turning, but 0.2 CPU s in 3 s: not burning
    f = assess(cap, work_pending=True, page=STALL)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.ADMISSION_STALL, f.reason
    # without a stalled page, a slow turn of the loop is neither work nor proof: the metric window decides
    f = assess(cap, work_pending=True, page=PageWork(running=1, waiting=0))
    assert f.decision is Decision.UNDECIDED and says(f.reason, "moved", "EngineCore's loop"), f.reason


def test_a_healthy_engine_between_steps_is_not_a_livelock() -> None:
    """Scheduling at one capture, the workers in the model at the next: the engine steps."""
    cap = capture(rnd(SCHEDULING, 5.0), rnd(ENGINE_WAITING, 7.5, tp0=WORKER_FORWARD, tp1=WORKER_FORWARD))
    for page in (PageWork(running=4, waiting=0), PageWork(running=1, waiting=2), None):
        f = assess(cap, work_pending=True, page=page)
        assert f.decision is Decision.WORKING and f.stuck_kind is None, f.reason
        assert "model_forward" in f.reason
    # the worker moving into a collective (not the loop) is movement that counts, as before
    cap = capture(rnd(ENGINE_WAITING, 5.0), rnd(ENGINE_WAITING, 5.0, tp0=[("GroupCoordinator.all_reduce",
                  f"{SITE}/vllm/distributed/parallel_state.py", 504), *WORKER_FORWARD]))
    f = assess(cap, work_pending=True, page=PageWork(running=1, waiting=0))
    assert f.decision is Decision.WORKING and says(f.reason, "moved", "Worker_TP0"), f.reason
    assert not says(f.reason, "Worker_TP1")


def test_a_parked_enginecore_spinning_is_not_called_a_livelock_without_its_loop() -> None:
    """A writer blocked on a full ring spins a core and never moves: a freeze of parked ranks, not a livelock."""
    writer: Frames = [("MessageQueue.acquire_write", f"{SITE}/vllm/distributed/device_communicators/shm_broadcast.py",
                       600), *ENGINE_WAITING[5:]]
    f = assess(capture(rnd(writer, 5.0), rnd(writer, 8.0)), work_pending=True, page=PageWork(running=2, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED


WRITER: Frames = [("MessageQueue.acquire_write", f"{SITE}/vllm/distributed/device_communicators/shm_broadcast.py",
                   600), *ENGINE_WAITING[5:]]


def test_a_writer_on_a_full_ring_while_every_worker_spins_in_its_reader_is_a_livelock() -> None:
    """Seen live on vLLM 0.32 (CPU, TP=2) with the injected livelock: EngineCore's empty steps outrun the workers, so
    py-spy finds it waiting for a free slot of the broadcast ring at both captures, while both workers spin in their
    reader (0.5-0.9 CPU s/s). The whole engine turns and nothing reaches the model: a livelock, not parked ranks."""
    spinning = capture(rnd(WRITER, 5.0, worker_cpu=20.0), rnd(WRITER, 7.5, worker_cpu=22.0))
    f = assess(spinning, work_pending=True, page=PageWork(running=2, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LIVELOCK, f.reason
    assert says(f.reason, "livelock", "EngineCore", "writer_blocked_full_ring"), f.reason
    # in the ring at one capture, in its loop at the other: still the loop turning, not "stacks moved"
    f = assess(capture(rnd(WRITER, 5.0, worker_cpu=20.0), rnd(UPDATING, 7.5, worker_cpu=22.0)), work_pending=True,
               page=PageWork(running=2, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LIVELOCK, f.reason


def test_a_writer_on_a_full_ring_with_a_reader_that_stopped_reading_is_parked() -> None:
    """The same writer, but one worker burns nothing between the captures (parked in its poll, or stopped): the ring
    is full because that reader stopped reading, a freeze of parked ranks, never a livelock."""
    quiet_tp1 = {**rnd(WRITER, 5.0, worker_cpu=20.0)}
    later = {**rnd(WRITER, 7.5, worker_cpu=22.0), TP1.pid: (WORKER_IDLE, "S", 20.0)}
    f = assess(capture(quiet_tp1, later), work_pending=True, page=PageWork(running=2, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED, f.reason
    stopped = {**rnd(WRITER, 7.5, worker_cpu=22.0), TP1.pid: (WORKER_IDLE, "T", 22.0)}
    first = {**rnd(WRITER, 5.0, worker_cpu=20.0), TP1.pid: (WORKER_IDLE, "T", 20.0)}
    f = assess(capture(first, stopped), work_pending=True, page=PageWork(running=2, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED, f.reason


def _spread(cap: Capture, seconds: float, quiet: dict[int, tuple[float, float]] | None) -> Capture:
    """The last round taken ``seconds`` after the first, each process's quiet pause set (None: not measured)."""
    last = {key: replace(d, t=d.t - 3.0 + seconds, quiet=(quiet or {}).get(key.pid))
            for key, d in cap.rounds[-1].items()}
    return replace(cap, rounds=(*cap.rounds[:-1], last))


def test_a_livelock_seen_waiting_on_its_replies_is_judged_by_the_cpu_of_the_quiet_pause() -> None:
    """Seen in a clean CI run (vLLM 0.32, CPU, TP=2, the injected livelock, running=2 on the page): EngineCore waited
    on its workers' replies at both captures, the workers spun in their readers, and py-spy's dumps of the spinning
    engine stretched the rounds ~20 s apart. EngineCore is suspended while dumped, so over that span it used 1.8 CPU
    s and fell under the 0.1 core/s of a burning loop: "every rank parked". The pause between the rounds, when no
    py-spy holds anyone, gives the true rate; and an EngineCore that burns waiting on replies while every worker burns
    in its reader is the whole engine turning empty steps (each step restarts the readers' one-second spin)."""
    page = PageWork(running=2, waiting=0)
    cap = capture(rnd(ENGINE_WAITING, 5.0), rnd(ENGINE_WAITING, 6.8, worker_cpu=23.0))
    stretched = _spread(cap, 20.0, None)
    f = assess(stretched, work_pending=True, page=page)  # the span alone: 1.8 CPU s in 20 s, under the burn
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED, f.reason
    quiet = {ENGINE.pid: (0.62, 3.0), TP0.pid: (1.5, 3.0), TP1.pid: (1.4, 3.0), API.pid: (0.0, 3.0)}
    f = assess(_spread(cap, 20.0, quiet), work_pending=True, page=page)
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.LIVELOCK, f.reason
    assert says(f.reason, "livelock", "EngineCore", "engine_waiting_workers", "0.62", "3 s"), f.reason
    assert by_pid(f)[ENGINE.pid].burn == (0.62, 3.0) and by_pid(f)[ENGINE.pid].gap == 20.0
    # a pause too short to read a rate by (clock ticks are 10 ms): the whole span decides, as before
    short = {pid: (q[0] / 10, 0.3) for pid, q in quiet.items()}
    assert assess(_spread(cap, 20.0, short), True, page).stuck_kind is StuckKind.PARKED


def test_an_enginecore_waiting_on_parked_workers_is_parked_even_while_it_spins() -> None:
    """The poll-parking signature with EngineCore still spinning in its reply wait: the workers burn nothing in the
    quiet pause (parked in their poll), so no step comes and goes: parked ranks, not a livelock."""
    cap = capture(rnd(ENGINE_WAITING, 5.0), rnd(ENGINE_WAITING, 7.0))
    quiet = {ENGINE.pid: (2.0, 3.0), TP0.pid: (0.0, 3.0), TP1.pid: (0.01, 3.0), API.pid: (0.0, 3.0)}
    f = assess(_spread(cap, 3.0, quiet), work_pending=True, page=PageWork(running=2, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED, f.reason


OLD_READER: Frames = [("MessageQueue.acquire_read", SHM, 420), ("_GeneratorContextManager.__enter__",
                                                                  f"{STDLIB}/contextlib.py", 137),
                      ("MessageQueue.dequeue", SHM, 480)]


def test_readers_that_spin_for_ever_say_nothing_about_steps_coming() -> None:
    """Older vLLM readers spin in acquire_read for as long as they wait (no SpinCondition, no poll): every worker and
    EngineCore burn while parked for good. Their burn is no sign of steps turning: parked, with its culprit."""
    old_idle: Frames = [*OLD_READER, ("WorkerProc.worker_busy_loop", MPX, 806), ("WorkerProc.worker_main", MPX, 707)]
    old_waiting: Frames = [*OLD_READER, *ENGINE_WAITING[len(READER):]]
    cap = capture(rnd(old_waiting, 5.0, tp0=old_idle, tp1=old_idle),
                  rnd(old_waiting, 6.8, tp0=old_idle, tp1=old_idle, worker_cpu=23.0))
    quiet = {ENGINE.pid: (2.5, 3.0), TP0.pid: (2.9, 3.0), TP1.pid: (2.8, 3.0), API.pid: (0.0, 3.0)}
    f = assess(_spread(cap, 3.0, quiet), work_pending=True, page=PageWork(running=2, waiting=0))
    assert f.decision is Decision.STUCK and f.stuck_kind is StuckKind.PARKED, f.reason
