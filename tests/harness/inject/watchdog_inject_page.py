"""The page faults of `watchdog_inject`, in vLLM's API server: its ``/metrics`` (prometheus_client's ASGI app, which
vLLM mounts) answers garbage or hangs while the flag file says so; every other route, and the engine, go on.

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

PAGE_GARBAGE = "page_garbage"
PAGE_HANG = "page_hang"
HANG_MAX_S = 120.0
GARBAGE = b"<html><body><h1>502 Bad Gat\x00\x00\x17\xff vllm:num_requests_running{{{ = ?\n"


def patch(module: ModuleType, mode: Callable[[], str]) -> None:
    """Wrap ``prometheus_client.make_asgi_app`` (as vLLM imports it) so that the apps it makes obey ``mode``."""
    if getattr(module, "_watchdog_injected", False):
        return
    make: Callable[..., Any] = module.make_asgi_app

    def make_patched(*args: Any, **kwargs: Any) -> Any:
        inner = make(*args, **kwargs)

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            waited = 0.0
            while mode() == PAGE_HANG and waited < HANG_MAX_S:
                await asyncio.sleep(0.2)
                waited += 0.2
            if mode() != PAGE_GARBAGE:
                await inner(scope, receive, send)
                return
            await receive()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]})
            await send({"type": "http.response.body", "body": GARBAGE})

        return app

    module.make_asgi_app = make_patched
    module._watchdog_injected = True
