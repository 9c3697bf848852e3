"""NCCL's own view of a job: its RAS service (NCCL 2.24+), queried on suspicion.

``query_ras`` is the I/O: a plain TCP connection to the RAS client port (127.0.0.1:28028 by default), the request
``CLIENT PROTOCOL 2`` + ``STATUS``, read until the server closes, with a hard deadline and a byte cap. A RAS that
does not answer (nothing listens: no NCCL 2.24+ or ``NCCL_RAS_ENABLE=0``; or it stalls with the job) is recorded
as such, never waited on past the deadline.

What the answer says (``parse_ras``, ``RasStatus``) is read in `watchdog.evidence.gpu.ras_status`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

REQUEST = b"CLIENT PROTOCOL 2\nSTATUS\n"


@dataclass(frozen=True, slots=True)
class RasAnswer:
    ok: bool
    text: str
    error: str  # why there is no (complete) answer
    seconds: float
    truncated: bool = False


def query_ras(host: str = "127.0.0.1", port: int = 28028, timeout: float = 5.0, max_bytes: int = 1024 * 1024,
              clock: Callable[[], float] = time.monotonic) -> RasAnswer:
    """Ask RAS for STATUS; the whole exchange ends by ``timeout`` seconds whatever the server does."""
    t0 = clock()
    deadline = t0 + timeout
    chunks: list[bytes] = []
    size = 0

    def answer(ok: bool, error: str, truncated: bool = False) -> RasAnswer:
        text = b"".join(chunks).decode("utf-8", "replace")
        return RasAnswer(ok, text, error, round(clock() - t0, 3), truncated)

    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(REQUEST)
            while True:
                left = deadline - clock()
                try:
                    if left <= 0:
                        raise TimeoutError
                    sock.settimeout(left)
                    data = sock.recv(65536)
                except TimeoutError:
                    what = "finish its answer" if chunks else "answer"
                    return answer(False, f"RAS at {host}:{port} did not {what} within {timeout:g}s "
                                         "(it may be stalled with the job)")
                if not data:
                    return answer(True, "")
                chunks.append(data[: max_bytes - size])
                size += len(data)
                if size >= max_bytes:
                    return answer(True, f"answer cut at {max_bytes} bytes", truncated=True)
    except ConnectionRefusedError:
        return answer(False, f"nothing listens on {host}:{port}: no NCCL RAS (NCCL older than 2.24, "
                             "NCCL_RAS_ENABLE=0, another NCCL_RAS_ADDR, or no communicator yet)")
    except TimeoutError:
        return answer(False, f"RAS at {host}:{port} did not answer within {timeout:g}s "
                             "(it may be stalled with the job)")
    except OSError as e:
        return answer(False, f"RAS at {host}:{port}: {e.strerror or e}")
