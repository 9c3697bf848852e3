"""The common model of process stacks that every dump parser produces. Pure data; frames are innermost first."""

from __future__ import annotations

from dataclasses import dataclass

# py-spy's JSON, text and --native; Python faulthandler; Python tracebacks; PyTorch Flight Recorder / gdb numbered
# frames; kernel stacks (/proc/PID/stack, a hung-task Call Trace).
SOURCES = ("py-spy-json", "py-spy-text", "py-spy-native", "faulthandler", "traceback", "numbered", "kernel")


class StackParseError(ValueError):
    """The input is structured (JSON) but is not a stack dump we can read."""


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str
    line: int | None
    native: bool = False


@dataclass(frozen=True, slots=True)
class ThreadStack:
    thread_id: str
    name: str
    frames: tuple[Frame, ...]  # innermost first
    active: bool | None
    gil: bool | None
    current: bool = False  # faulthandler's "Current thread": the one that crashed or received the signal


@dataclass(frozen=True, slots=True)
class ProcessStack:
    pid: int | None
    title: str
    threads: tuple[ThreadStack, ...]
    source: str  # one of SOURCES
