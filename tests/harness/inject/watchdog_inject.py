"""Faults injected into vLLM's V1 engine (0.25.1 and 0.32.0), switched at run time by a flag file (tests only).

WATCHDOG_TEST_INJECT names the flag file; its content is the fault, read again at most every 0.2 s:

- ``admission_stall``: no waiting request is ever admitted. ``KVCacheManager.allocate_slots`` answers None (no
  free blocks) for a request that has not started, the scheduler's own "cannot be scheduled" path; EngineCore
  keeps stepping: ``schedule()`` returns an empty batch, the empty step goes to the workers, ``update_from_output``
  publishes running=0, waiting=N, and the loop turns again. (0.32.0: its scheduler's pause state is needed.)
- ``livelock``: the requests already running get no tokens: ``Scheduler.schedule`` runs with the scheduler's own
  ``PAUSED_ALL`` state (token budget 0) while there are running requests; EngineCore turns its loop through empty
  steps with running>0 and nothing moves on the page. (0.32.0.)
- ``lost_wakeup``: the lost wake-up of vLLM PR #45224. In EngineCore (the broadcast ring's writer) every
  ``SpinCondition.notify`` sends nothing; the block is written to the ring as usual and the remote readers (workers
  on another node) get their copy over ZMQ as usual. A local reader that has left its busy spin (1 s after its last
  read) and polls its notify socket never hears of the block: in 0.25.x it polls with no timeout and parks for good;
  from 0.27.0 it re-checks the ring every 5 s and finds it.
  Once the flag is cleared, the dropped notifies are sent late (the reader wakes, the step runs): one engine serves
  one scenario after another.
- ``lost_wakeup_slow``: the same, and EngineCore waits ``SLOW_WRITE_S`` before each write, so the readers are in their
  poll even under load (as when a step takes over a second at high concurrency).
- ``diverge``: the ranks diverge once: the first step Worker_TP1 runs with the fault armed ends with a collective its
  peers never join (a barrier on the TP group's CPU group, after ``execute_model``); Worker_TP0 goes on to the next
  collective of the step (or of the next step) and waits there for ever. It fires once per arming: the flag must be
  cleared and written again to fire again.
- ``gpu_spin`` (CUDA): the next step's ``Worker.execute_model`` first queues one kernel that spins for
  ``SPIN_S`` (``WATCHDOG_TEST_SPIN_S``, default 60 s) on the GPU (`watchdog_inject_gpu.spin`): the step's kernels
  wait behind it and EngineCore (TP=1: it runs the model itself) waits on its own GPU. Once per arming; the
  kernel ends by itself and the engine goes on.
- ``illegal_access``: a request that asks for a repetition penalty makes the sampler's penalty step access memory
  outside a tensor, and the engine dies of it, the server with it, as when a ``repetition_penalty`` request crashes
  a real deployment's speculative path. On CUDA a kernel stores outside its memory
  (`watchdog_inject_gpu.illegal_access`): ``CUDA error: an illegal memory access was encountered`` at the next
  synchronisation, in EngineCore. On the CPU build torch checks the same access and refuses it: ``IndexError:
  index ... is out of bounds``, raised in each worker's sampler; EngineCore dies of the failed step.
- ``page_garbage``, ``page_hang``: the API server's ``/metrics`` answers garbage or hangs
  (`watchdog_inject_page`); the engine serves on.
- anything else, an empty file or no file: no fault; vLLM behaves as shipped.

The modules are patched right after they are imported (a meta-path finder), in whichever process imports them.
Nothing is patched when WATCHDOG_TEST_INJECT is unset (sitecustomize).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ENV = "WATCHDOG_TEST_INJECT"
ADMISSION_STALL = "admission_stall"
LIVELOCK = "livelock"
LOST_WAKEUP = "lost_wakeup"
LOST_WAKEUP_SLOW = "lost_wakeup_slow"
DIVERGE = "diverge"
SLOW_WRITE_S = 1.3  # past the readers' 1 s busy spin: they poll when the block comes
SCHEDULER = "vllm.v1.core.sched.scheduler"
RING = "vllm.distributed.device_communicators.shm_broadcast"
WORKER = "vllm.v1.worker.gpu_worker"
PENALTIES = "vllm.v1.worker.gpu.sample.penalties"
SAMPLER = "vllm.v1.sample.sampler"
GPU_SPIN = "gpu_spin"
ILLEGAL_ACCESS = "illegal_access"
SPIN_S = float(os.environ.get("WATCHDOG_TEST_SPIN_S", "60"))

_cache: list[Any] = [0.0, ""]  # [monotonic time read, mode]


def mode() -> str:
    now = time.monotonic()
    if now - _cache[0] >= 0.2:
        try:
            with open(os.environ.get(ENV, ""), encoding="utf-8") as f:
                _cache[1] = f.read().strip()
        except OSError:
            _cache[1] = ""
        _cache[0] = now
    return str(_cache[1])


def _title() -> str:
    """This process's title as vLLM set it (VLLM::EngineCore, VLLM::Worker_TP1): read at the call, not at import."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def _announce(what: str) -> None:
    print(f"watchdog_inject: patched {what} in pid {os.getpid()} (flag file {os.environ.get(ENV)})",
          file=sys.stderr, flush=True)


def _patch_ring(module: ModuleType) -> None:
    """lost_wakeup(_slow): EngineCore's notify to its local readers sends nothing (the write is made as usual)."""
    cond, queue = module.SpinCondition, module.MessageQueue
    if getattr(cond, "_watchdog_injected", False):
        return
    notify: Callable[..., Any] = cond.notify
    enqueue: Callable[..., Any] = queue.enqueue

    wait: Callable[..., Any] = cond.wait

    def send_late() -> None:
        with _lock:
            conds = list(_dropped)
            _dropped.clear()
        for c in conds:
            notify(c)
        print(f"watchdog_inject: lost_wakeup lifted: {len(conds)} dropped notify sent late", file=sys.stderr,
              flush=True)

    def wait_patched(self: Any, timeout_ms: int | None = None) -> Any:
        # EngineCore waits on its workers' replies here (its own reader). While notifies it dropped are pending, it
        # waits in slices of 0.2 s and, once the fault is lifted, sends them from this, its main thread (ZMQ sockets
        # belong to one thread): the parked readers wake, and one engine serves one scenario after another.
        if _dropped and _title().startswith("VLLM::EngineCore"):
            if mode() not in (LOST_WAKEUP, LOST_WAKEUP_SLOW):
                send_late()
            else:
                timeout_ms = 200 if timeout_ms is None else min(timeout_ms, 200)
        return wait(self, timeout_ms)

    def notify_patched(self: Any) -> Any:
        if mode() in (LOST_WAKEUP, LOST_WAKEUP_SLOW) and _title().startswith("VLLM::EngineCore"):
            # dropped, as a PUB socket at its high-water mark drops it; sent late once the fault is lifted
            with _lock:
                if self not in _dropped:
                    _dropped.append(self)
            return None
        return notify(self)

    def enqueue_patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        if mode() == LOST_WAKEUP_SLOW and _title().startswith("VLLM::EngineCore"):
            time.sleep(SLOW_WRITE_S)
        return enqueue(self, *args, **kwargs)

    cond.notify = notify_patched
    cond.wait = wait_patched
    queue.enqueue = enqueue_patched
    cond._watchdog_injected = True
    _announce(RING)


_lock = threading.Lock()
_dropped: list[Any] = []  # the writers whose notify was dropped, until the fault is lifted
_fired: list[bool] = [False]  # diverge fired in this arming


def _patch_worker(module: ModuleType) -> None:
    """diverge: Worker_TP1 enters one collective its peers never join, once, right after a step's execute_model."""
    worker = module.Worker
    if getattr(worker, "_watchdog_injected", False):
        return
    execute: Callable[..., Any] = worker.execute_model

    def execute_patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        _spin_once()
        out = execute(self, *args, **kwargs)
        if mode() != DIVERGE:
            _fired[0] = False
            return out
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        if not _fired[0] and tp.world_size > 1 and tp.rank_in_group == 1:
            _fired[0] = True
            print(f"watchdog_inject: diverge: {_title()} enters a barrier its peers never join", file=sys.stderr,
                  flush=True)
            tp.barrier()
        return out

    worker.execute_model = execute_patched
    worker._watchdog_injected = True
    _announce(WORKER)


def _patch_scheduler(scheduler_module: ModuleType) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    try:
        from vllm.v1.core.sched.interface import PauseState
    except ImportError:  # vLLM 0.25: no pause state; the livelock fault is 0.32's
        PauseState = None

    scheduler_cls = scheduler_module.Scheduler
    if getattr(scheduler_cls, "_watchdog_injected", False):
        return
    allocate: Callable[..., Any] = KVCacheManager.allocate_slots
    schedule: Callable[..., Any] = scheduler_cls.schedule

    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if mode() == ADMISSION_STALL and request.status == RequestStatus.WAITING and request.num_computed_tokens == 0:
            return None  # "no free blocks": the request stays waiting
        return allocate(self, request, *args, **kwargs)

    def schedule_patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        if mode() == LIVELOCK and self.running and PauseState is not None:
            saved, self._pause_state = self._pause_state, PauseState.PAUSED_ALL
            try:
                return schedule(self, *args, **kwargs)
            finally:
                self._pause_state = saved
        return schedule(self, *args, **kwargs)

    KVCacheManager.allocate_slots = allocate_slots  # type: ignore[method-assign]
    scheduler_cls.schedule = schedule_patched
    scheduler_cls._watchdog_injected = True
    _announce(SCHEDULER)


_spun: list[bool] = [False]  # gpu_spin fired in this arming


def _spin_once() -> None:
    """gpu_spin: the step's kernels queue behind a kernel that spins for SPIN_S, once per arming."""
    if mode() != GPU_SPIN:
        _spun[0] = False
    elif not _spun[0]:
        _spun[0] = True
        import watchdog_inject_gpu

        cycles = watchdog_inject_gpu.spin(SPIN_S)
        print(f"watchdog_inject: gpu_spin: {_title()} queued a kernel of {cycles} cycles (~{SPIN_S:g} s)",
              file=sys.stderr, flush=True)


def _illegal_access() -> None:
    import torch

    print(f"watchdog_inject: illegal_access: {_title()} stores outside its memory in the penalty step",
          file=sys.stderr, flush=True)
    if not torch.cuda.is_available():  # the CPU build: torch bounds-checks the index and raises IndexError
        torch.zeros(4).index_fill_(0, torch.tensor([1 << 42]), 1.0)
        return
    import watchdog_inject_gpu

    watchdog_inject_gpu.illegal_access()


def _patch_sampler(module: ModuleType) -> None:
    """illegal_access (V1 runner's sampler): the penalty step of a request with a repetition penalty stores outside
    its memory."""
    if getattr(module, "_watchdog_injected", False):
        return
    penalties: Callable[..., Any] = module.apply_all_penalties

    def penalties_patched(logits: Any, prompt_token_ids: Any, presence: Any, frequency: Any, repetition: Any,
                          *args: Any, **kwargs: Any) -> Any:
        if mode() == ILLEGAL_ACCESS and bool((repetition != 1.0).any()):
            _illegal_access()
        return penalties(logits, prompt_token_ids, presence, frequency, repetition, *args, **kwargs)

    module.apply_all_penalties = penalties_patched
    module._watchdog_injected = True
    _announce(SAMPLER)


def _patch_penalties(module: ModuleType) -> None:
    """illegal_access (the GPU model runner V2, CUDA's default in 0.25): its penalty kernel runs only for requests
    with a penalty; the fault stores outside its memory right before it."""
    if getattr(module, "_watchdog_injected", False):
        return
    penalties: Callable[..., Any] = module.apply_penalties

    def penalties_patched(*args: Any, **kwargs: Any) -> Any:
        if mode() == ILLEGAL_ACCESS:
            _illegal_access()
        return penalties(*args, **kwargs)

    module.apply_penalties = penalties_patched
    module._watchdog_injected = True
    _announce(PENALTIES)


def _patch_page(module: ModuleType) -> None:
    import watchdog_inject_page

    watchdog_inject_page.patch(module, mode)
    _announce(watchdog_inject_page.MODULE)


PATCHES: dict[str, Callable[[ModuleType], None]] = {SCHEDULER: _patch_scheduler, RING: _patch_ring,
                                                     WORKER: _patch_worker, SAMPLER: _patch_sampler,
                                                     PENALTIES: _patch_penalties,
                                                     "vllm.entrypoints.serve.instrumentator.metrics": _patch_page}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        PATCHES[module.__name__](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
