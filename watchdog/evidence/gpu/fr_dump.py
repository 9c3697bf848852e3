"""A Flight Recorder dump's bytes, decoded safely: JSON, or a pickle through an unpickler that refuses every class.

A dump (see `watchdog.evidence.gpu.flight_recorder`) is a pickle of builtins only, or JSON when torch wrote JSON;
no class is ever loaded, so a hostile file cannot run code. Unpickling lives here, apart from the summaries that
read the decoded dict, and is used by `watchdog.evidence.gpu.fr_trigger` (which reads the files) and
`watchdog.evidence.gpu.gather`.
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

from watchdog.evidence.gpu.flight_recorder import DumpError

__all__ = ["MAX_DUMP_BYTES", "DumpError", "load_dump"]

MAX_DUMP_BYTES = 64 * 1024 * 1024


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a Flight Recorder dump holds builtins only")


def load_dump(data: bytes, max_bytes: int = MAX_DUMP_BYTES) -> dict[str, Any]:
    """A dump (pickle, or JSON when torch wrote JSON) as a dict. Raises DumpError; never runs code from the file."""
    if len(data) > max_bytes:
        raise DumpError(f"dump of {len(data)} bytes is over the {max_bytes} byte cap")
    if not data:
        raise DumpError("empty dump")
    try:
        obj = json.loads(data) if data[:1] == b"{" else _BuiltinsOnly(io.BytesIO(data)).load()
    except RecursionError:
        raise DumpError("unreadable dump: nested too deep") from None
    except Exception as e:  # whatever the bytes make the decoder raise, the dump is unreadable
        why = "".join(c if c.isprintable() else "?" for c in str(e)[:200])
        raise DumpError(f"unreadable dump: {type(e).__name__}: {why}") from None
    if not isinstance(obj, dict):
        raise DumpError(f"a dump is a dict, this is a {type(obj).__name__}")
    return obj
