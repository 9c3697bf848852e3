"""Faults injected into vLLM 0.32's V1 scheduler, switched at run time by a flag file (tests only).

WATCHDOG_TEST_INJECT names the flag file; its content is the fault, read again at most every 0.2 s:

- ``admission_stall``: no waiting request is ever admitted. ``KVCacheManager.allocate_slots`` answers None (no
  free blocks) for a request that has not started, the scheduler's own "cannot be scheduled" path; EngineCore
  keeps stepping: ``schedule()`` returns an empty batch, the empty step goes to the workers, ``update_from_output``
  publishes running=0, waiting=N, and the loop turns again.
- ``livelock``: the requests already running get no tokens: ``Scheduler.schedule`` runs with the scheduler's own
  ``PAUSED_ALL`` state (token budget 0) while there are running requests; EngineCore turns its loop through empty
  steps with running>0 and nothing moves on the page.
- anything else, an empty file or no file: no fault; vLLM behaves as shipped.

The modules are patched right after they are imported (a meta-path finder), in whichever process imports them
(EngineCore: the scheduler lives there). Nothing is patched when WATCHDOG_TEST_INJECT is unset (sitecustomize).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ENV = "WATCHDOG_TEST_INJECT"
ADMISSION_STALL = "admission_stall"
LIVELOCK = "livelock"
TARGET = "vllm.v1.core.sched.scheduler"

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


def _patch(scheduler_module: ModuleType) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.request import RequestStatus

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
        if mode() == LIVELOCK and self.running:
            saved, self._pause_state = self._pause_state, PauseState.PAUSED_ALL
            try:
                return schedule(self, *args, **kwargs)
            finally:
                self._pause_state = saved
        return schedule(self, *args, **kwargs)

    KVCacheManager.allocate_slots = allocate_slots  # type: ignore[method-assign]
    scheduler_cls.schedule = schedule_patched
    scheduler_cls._watchdog_injected = True
    print(f"watchdog_inject: patched {TARGET} in pid {os.getpid()} (flag file {os.environ.get(ENV)})",
          file=sys.stderr, flush=True)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
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
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
