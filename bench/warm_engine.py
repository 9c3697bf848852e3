"""A real vLLM (CPU build, TP=2, the fast test model) up and warmed for a benchmark, in a temporary directory."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness.engine_env import engine_python  # noqa: E402
from tests.harness.models import fast_model  # noqa: E402
from tests.harness.server import VllmServer  # noqa: E402


@contextlib.contextmanager
def warm_engine(prefix: str) -> Iterator[tuple[VllmServer, Path]]:
    """The server, ready and past its first generation, and its working directory; stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = VllmServer(engine_python(), fast_model(), Path(tmp))
        with server:
            server.wait_ready(300)
            server.complete("warm up", max_tokens=8)
            yield server, Path(tmp)
