"""A verb's arguments, checked before anything is done with them. Pure: a decoded request in, typed values out.

(The request's JSON itself is read by `watchdog.nodes.protocol.parse_args`: nesting, size, NaN, keys given twice.)
`check_args`: a verb's arguments, each key known to that verb (an unknown key is refused, not ignored), each
  value of its type and in its range: a boolean is ``true`` or ``false`` (never a string or a number), an integer a
  whole number (never ``1.5`` nor ``true``), lists of bounded length. Missing keys take their defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from watchdog.config.nodes import CAPTURE_GAP, CAPTURE_ROUNDS, CAPTURE_TIMEOUT, LIVENESS_INTERVAL, MAX_LOG_LINES
from watchdog.nodes.protocol import LOG_KINDS, ProtocolError

PID_MAX = 1 << 22  # the kernel's highest pid_max
MAX_ITEMS = 1024  # list lengths
MAX_STRING = 4096  # one argv item, one log name


# ---------------------------------------------------------------- each verb's arguments


@dataclass(frozen=True, slots=True)
class Bool:
    default: bool


@dataclass(frozen=True, slots=True)
class Int:
    default: int
    low: int
    high: int


@dataclass(frozen=True, slots=True)
class Num:
    default: float | None  # None: the node's own setting
    low: float
    high: float


@dataclass(frozen=True, slots=True)
class Pids:
    """A list of pids (1 .. PID_MAX), at most MAX_ITEMS."""


@dataclass(frozen=True, slots=True)
class Argv:
    """A non-empty list of strings (no NUL), at most 256, each at most MAX_STRING characters."""


@dataclass(frozen=True, slots=True)
class Log:
    """{} or one of LOG_KINDS -> a non-empty string (which one is allowed is `protocol.choose_log`'s rule)."""


Spec = Bool | Int | Num | Pids | Argv | Log

ARGS: dict[str, dict[str, Spec]] = {
    "version": {},
    "list": {},
    # the ranges are the head's too (`watchdog.config.nodes`): what its config accepts, every node takes
    "stacks": {"pids": Pids(), "rounds": Int(2, *CAPTURE_ROUNDS), "gap": Num(3.0, *CAPTURE_GAP),
               "timeout": Num(None, *CAPTURE_TIMEOUT), "native": Bool(False), "locals": Bool(False)},
    "context": {"lines": Int(200, 0, MAX_LOG_LINES), "log": Log()},
    "liveness": {"interval": Num(2.0, *LIVENESS_INTERVAL)},
    "run": {"argv": Argv(), "timeout": Num(300.0, 0.1, 7200)},
    "shm": {"remove": Bool(False)},
    "ring": {},  # read-only: the broadcast ring's flags of this node's engine processes
}
REQUIRED = {"run": ("argv",)}


def _value(verb: str, key: str, spec: Spec, value: Any) -> Any:
    where = f"{verb}: {key}"
    if isinstance(spec, Bool):
        if not isinstance(value, bool):
            raise ProtocolError(f"{where} must be true or false")
        return value
    if isinstance(spec, Int):
        if isinstance(value, bool) or not isinstance(value, int) or not spec.low <= value <= spec.high:
            raise ProtocolError(f"{where} must be a whole number in {spec.low}..{spec.high}")
        return value
    if isinstance(spec, Num):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not spec.low <= value <= spec.high:
            raise ProtocolError(f"{where} must be a number in {spec.low:g}..{spec.high:g}")
        return float(value)
    if isinstance(spec, Pids):
        if not isinstance(value, list) or len(value) > MAX_ITEMS or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 < v < PID_MAX for v in value):
            raise ProtocolError(f"{where} must be a list of at most {MAX_ITEMS} pids (whole numbers 1..{PID_MAX - 1})")
        return tuple(value)
    if isinstance(spec, Argv):
        if not isinstance(value, list) or not 0 < len(value) <= 256 or not all(
                isinstance(v, str) and len(v) <= MAX_STRING and "\0" not in v for v in value):
            raise ProtocolError(f"{where} must be a list of 1 to 256 strings (no NUL, each at most {MAX_STRING})")
        return tuple(value)
    if not isinstance(value, dict) or len(value) > 1 or any(
            k not in LOG_KINDS or not isinstance(v, str) or not v or len(v) > MAX_STRING or "\0" in v
            for k, v in value.items()):
        raise ProtocolError(f"{where} must be an object with one of {', '.join(LOG_KINDS)} (a non-empty string)")
    return dict(value)


def check_args(verb: str, args: dict[str, Any]) -> dict[str, Any]:
    """Every argument of ``verb`` typed and in range, defaults filled in; ProtocolError naming the first wrong key."""
    specs = ARGS[verb]
    unknown = sorted(k for k in args if k not in specs)
    if unknown:
        known = ", ".join(specs) or "none"
        raise ProtocolError(f"{verb}: unknown argument {unknown[0][:60]!r} (it takes: {known})")
    for key in REQUIRED.get(verb, ()):
        if key not in args:
            raise ProtocolError(f"{verb}: {key} is required")
    out: dict[str, Any] = {}
    for key, spec in specs.items():
        if key in args:
            out[key] = _value(verb, key, spec, args[key])
        elif isinstance(spec, Bool | Int | Num):
            out[key] = spec.default
        else:
            out[key] = () if isinstance(spec, Pids) else {}
    return out
