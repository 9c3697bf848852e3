"""The page faults of `watchdog_inject`, in vLLM's API server: its ``/metrics`` answers garbage or hangs while the
flag file says so; every other route, and the engine, go on. An ASGI middleware put on the app when vLLM attaches
its metrics router (``vllm.entrypoints.serve.instrumentator.metrics.attach_router``, 0.25.1 and 0.32.0), so it
stands in front of whichever handler serves the page.

- ``page_garbage``: 200 with a body that is no exposition format (a proxy's error page cut short, bytes of
  nothing), as a broken proxy or a half-written multiprocess file would give;
- ``page_hang``: the request is held (without blocking the server's event loop) until the flag changes, at most
  ``HANG_MAX_S``, then answered as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import ModuleType
from typing import Any

MODULE = "vllm.entrypoints.serve.instrumentator.metrics"
PAGE_GARBAGE = "page_garbage"
PAGE_HANG = "page_hang"
HANG_MAX_S = 120.0
GARBAGE = b"<html><body><h1>502 Bad Gat\x00\x00\x17\xff vllm:num_requests_running{{{ = ?\n"


def patch(module: ModuleType, mode: Callable[[], str]) -> None:
    """Wrap ``attach_router(app)`` so that the app gets the page-fault middleware first."""
    if getattr(module, "_watchdog_injected", False):
        return
    attach: Callable[..., Any] = module.attach_router

    class PageFault:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope.get("type") == "http" and str(scope.get("path", "")).startswith("/metrics"):
                waited = 0.0
                while mode() == PAGE_HANG and waited < HANG_MAX_S:
                    await asyncio.sleep(0.2)
                    waited += 0.2
                if mode() == PAGE_GARBAGE:
                    await send({"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
                    await send({"type": "http.response.body", "body": GARBAGE})
                    return
            await self.app(scope, receive, send)

    def attach_patched(app: Any, *args: Any, **kwargs: Any) -> Any:
        app.add_middleware(PageFault)
        return attach(app, *args, **kwargs)

    module.attach_router = attach_patched
    module._watchdog_injected = True
