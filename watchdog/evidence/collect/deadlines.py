"""The deadline the evidence races: the engine's own timeouts that kill every process (and every stack with them),
read from the engine processes' environment and command lines, against the time the watchdog needs to confirm.

Pure: settings in (what each process's environment and argv held), a report out.

The confirmation time is the worst case, counted from the moment the engine stops making progress, to both the stacks
being taken and the freeze being declared::

    capture   = rounds * 2 * capture.timeout + (rounds - 1) * capture.gap   (a dump may run twice: --nonblocking retry)
    evidence  = suspect_after + interval + capture                          (suspicion is seen on a scrape)
    confirm   = max(evidence, stall_window + interval)                      (or the metric window decides)

It is compared with the earliest deadline: a warning when ``confirm > margin * deadline`` (margin 0.5: the evidence
must be in with half the engine's own timeout still to go). The engine's clock starts about when progress stops
(EngineCore starts waiting for a step), so both sides count from the same moment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MARGIN = 0.5


@dataclass(frozen=True, slots=True)
class Known:
    """One setting we know: where it lives, its unit, its default and what happens when it fires."""

    name: str  # environment variable, or a command-line flag ("--...")
    scale: float  # to seconds (VLLM_RPC_TIMEOUT is in milliseconds)
    default: float | None  # counted even when unset (only where the default certainly applies)
    counted: bool  # fires on a hang and takes the processes (and their stacks) down
    what: str


KNOWN: tuple[Known, ...] = (
    Known("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 1.0, 300.0, True,
          "EngineCore's wait for a worker's reply; then EngineDeadError and every engine process is killed"),
    Known("VLLM_ENGINE_ITERATION_TIMEOUT_S", 1.0, None, True,
          "V0 engine: one engine iteration; then the engine is dead (counted only when set: V1 does not use it)"),
    Known("--distributed-timeout-seconds", 1.0, None, True,
          "torch.distributed process-group timeout: the NCCL watchdog aborts the collective and the rank"),
    Known("--cpu-distributed-timeout-seconds", 1.0, None, True,
          "gloo (CPU) process-group timeout: the collective raises and the rank dies"),
    Known("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", 1.0, None, True,
          "PyTorch's NCCL heartbeat monitor kills the process when the NCCL watchdog thread is stuck this long "
          "(default 480 s; counted only when set)"),
    Known("--watchdog-timeout", 1.0, None, True, "SGLang's watchdog: dumps local schedulers, then kills the server"),
    Known("VLLM_RPC_TIMEOUT", 0.001, None, False,
          "frontend RPC calls to the engine (milliseconds); not a step timeout"),
    Known("TORCH_NCCL_ASYNC_ERROR_HANDLING", 0.0, None, False,
          "0: a timed-out collective is not acted on (the process-group timeout then kills nothing)"),
    Known("TORCH_NCCL_BLOCKING_WAIT", 0.0, None, False, "1: a timed-out collective raises in the waiting thread"),
)
_BY_NAME = {k.name: k for k in KNOWN}
_PG = ("--distributed-timeout-seconds", "--cpu-distributed-timeout-seconds")


@dataclass(frozen=True, slots=True)
class ProcessSettings:
    """What one engine process was started with (the I/O side reads it from /proc)."""

    pid: int
    label: str
    env: Mapping[str, str]
    argv: Sequence[str]
    error: str = ""  # why env or argv could not be read


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    raw: str
    seconds: float | None  # None: not a duration (a switch), or not a number
    counted: bool
    where: str  # "environment of pid 12 (VLLM::EngineCore)", "command line of pid 10", "vLLM's default"
    what: str


@dataclass(frozen=True, slots=True)
class DeadlineReport:
    settings: tuple[Setting, ...]
    earliest: Setting | None
    confirm_seconds: float
    margin: float
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.earliest is None or self.earliest.seconds is None or (
            self.confirm_seconds <= self.margin * self.earliest.seconds)

    @property
    def warning(self) -> str:
        e = self.earliest
        if self.ok or e is None or e.seconds is None:
            return ""
        return (f"the watchdog needs up to {self.confirm_seconds:.0f}s to take the stacks and confirm a freeze, but "
                f"{e.name}={e.raw} ({e.where}) kills the engine and its stacks after {e.seconds:g}s: keep the "
                f"confirmation under {self.margin:g} of it (lower judge.suspect_after/stall_window or capture.timeout, "
                f"or raise {e.name})")

    def as_dict(self) -> dict[str, Any]:
        return {"earliest": None if self.earliest is None else {"name": self.earliest.name,
                                                                "seconds": self.earliest.seconds,
                                                                "where": self.earliest.where},
                "confirm_seconds": round(self.confirm_seconds, 1), "margin": self.margin, "ok": self.ok,
                "warning": self.warning or None, "problems": list(self.problems),
                "settings": [{"name": s.name, "value": s.raw, "seconds": s.seconds, "counted": s.counted,
                              "where": s.where, "what": s.what} for s in self.settings]}


def confirm_seconds(suspect_after: float, stall_window: float, interval: float, rounds: int, gap: float,
                    capture_timeout: float) -> float:
    """Worst case from the last progress to stacks taken and the freeze declared (see the module's docstring)."""
    capture = rounds * 2 * capture_timeout + max(0, rounds - 1) * gap
    return max(suspect_after + interval + capture, stall_window + interval)


def _flag(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _seconds(raw: str, scale: float) -> float | None:
    if not scale:
        return None
    try:
        value = float(raw) * scale
    except ValueError:
        return None
    return value if value > 0 else None


def settings_of(proc: ProcessSettings) -> list[Setting]:
    """The known settings one process holds, in the order of KNOWN."""
    out = []
    for k in KNOWN:
        if k.name.startswith("--"):
            raw, where = _flag(proc.argv, k.name), f"command line of pid {proc.pid} ({proc.label})"
        else:
            raw, where = proc.env.get(k.name), f"environment of pid {proc.pid} ({proc.label})"
        if raw is not None:
            out.append(Setting(k.name, raw, _seconds(raw, k.scale), k.counted, where, k.what))
    return out


def report(processes: Sequence[ProcessSettings], confirm: float, margin: float = MARGIN) -> DeadlineReport:
    """Every known setting found (the first process that holds each; the smallest value where they differ), the
    defaults that certainly apply, and the earliest deadline among them."""
    found: dict[str, Setting] = {}
    for proc in processes:
        for s in settings_of(proc):
            old = found.get(s.name)
            if old is None or (s.seconds is not None and (old.seconds is None or s.seconds < old.seconds)):
                found[s.name] = s
    for k in KNOWN:
        if k.default is not None and k.name not in found:
            found[k.name] = Setting(k.name, f"{k.default:g}", k.default, k.counted,
                                    "vLLM's default (not set in any engine process read)", k.what)
    async_eh = found.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    blocking = found.get("TORCH_NCCL_BLOCKING_WAIT")
    pg_inert = async_eh is not None and async_eh.raw.strip() == "0" and (blocking is None or blocking.raw != "1")
    settings = tuple(s if not (pg_inert and s.name in _PG) else
                     Setting(s.name, s.raw, s.seconds, False, s.where, s.what + " (not counted: "
                             "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 and no blocking wait)") for s in
                     sorted(found.values(), key=lambda s: list(_BY_NAME).index(s.name)))
    timed = [s for s in settings if s.counted and s.seconds is not None]
    earliest = min(timed, key=lambda s: s.seconds or 0.0) if timed else None
    problems = tuple(f"pid {p.pid} ({p.label}): {p.error}" for p in processes if p.error)
    if not processes:
        problems += ("no engine process found to read settings from: defaults assumed",)
    return DeadlineReport(settings, earliest, confirm, margin, problems)


def lines(d: Mapping[str, Any]) -> list[str]:
    """For `watchdog status` (from the dict status.json holds): the earliest deadline against the confirmation time,
    then the warning and the problems, if any."""
    e, confirm = d.get("earliest"), float(d.get("confirm_seconds") or 0.0)
    head = (f"deadline: {e['name']} ({e['where']}): {e['seconds']:g}s; confirmation takes up to {confirm:.0f}s "
            f"({'ok' if d.get('ok') else 'TOO LATE'}, margin {d.get('margin')})"
            if e else f"deadline: none known; confirmation takes up to {confirm:.0f}s")
    return [head, *([f"WARNING: {d['warning']}"] if d.get("warning") else []),
            *[f"  ({p})" for p in d.get("problems") or []]]
