"""Line shapes of the stack formats people paste, other than py-spy's own: pure recognisers, one line in, a frame out.

- Python tracebacks: ``  File "f.py", line 3, in func`` (innermost LAST; the parser reverses them);
- numbered frames, innermost first: PyTorch's Flight Recorder / NCCL watchdog (``#0 all_reduce from f.py:3068``)
  and gdb (``#3  0x7f... in cuEventSynchronize () from /lib/libcuda.so.1``, ``#0  syscall () at x.S:38``);
- kernel stacks: ``/proc/PID/stack`` (``[<0>] futex_wait_queue+0x5b/0x90``, ``[<ffff...>] uvm_spin_loop+0xb2/0xe0
  [nvidia_uvm]``) and a hung-task ``Call Trace:`` from dmesg (``  __schedule+0x23d/0x590``; ``?`` frames dropped);
- the prefixes pasted text carries: markdown quotes, vLLM/SGLang log prefixes, ``[rank0]:``, docker timestamps.
"""

from __future__ import annotations

import re

from watchdog.evidence.stacks.frames import Frame

TRACEBACK = re.compile(r"^\s*Traceback \(most recent call last\):\s*$")
CHAINED = re.compile(r"^\s*(?:The above exception was the direct cause of the following exception"
                     r"|During handling of the above exception, another exception occurred):\s*$")
_TB_FRAME = re.compile(r'^(?P<ind>\s*)File "(?P<file>[^"]*)", line (?P<line>\d+|\?+), in (?P<func>\S.*?)\s*$')
# "#0 all_reduce from /x/distributed_c10d.py:3068" (Flight Recorder), "#1 torch::unwind::unwind() from ??:0"
_FR_FRAME = re.compile(r"^\s*#(?P<n>\d+)\s+(?P<func>\S.*?) from (?P<file>\S.*?)(?::(?P<line>\d+))?\s*$")
# gdb: "#14 0x000014cd in cudaMemcpyAsync () from /lib/libcudart.so", "#0  syscall () at ../syscall.S:38"
_GDB_FRAME = re.compile(r"^\s*#(?P<n>\d+)\s+(?:0x[0-9a-fA-F]+ in )?(?P<func>\S.*?) \((?P<args>[^()]*)\)"
                        r"(?: (?:from|at) (?P<file>\S+?)(?::(?P<line>\d+))?)?\s*$")
_GDB_THREAD = re.compile(r'^Thread (?P<n>\d+) \(Thread 0x[0-9a-fA-F]+ \(LWP (?P<lwp>\d+)\)'
                         r'(?: "(?P<name>[^"]*)")?\):\s*$')
_KERNEL = re.compile(r"^\s*(?:\[<(?:0|[0-9a-fA-F]{8,16})>\]\s*)?(?P<unsure>\?\s+)?(?P<func>[A-Za-z_.][\w.]*)"
                     r"\+0x[0-9a-fA-F]+/0x[0-9a-fA-F]+(?:\s+\[(?P<module>\w+)\])?\s*$")
_KERNEL_ADDR = re.compile(r"^\s*\[<(?:0|[0-9a-fA-F]{8,16})>\]")
_TASK = re.compile(r"^\s*(?:INFO: )?task:?(?P<comm>\S+?)\s+state:(?P<state>\w)\b.*?\bpid:\s*(?P<pid>\d+)")
_DMESG_TS = re.compile(r"^\[\s*[+]?\d+\.\d+\]\s?")
# Prefixes, outermost first: a markdown quote, a docker/kubectl timestamp, "[rank0]:", a vLLM log header
# ("ERROR 06-05 16:27:39 [core.py:502] ", "ERROR 01-29 20:00:47 multiproc_worker_utils.py:240] ").
_PREFIXES = (
    re.compile(r"^>\s?"),
    re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\s"),
    re.compile(r"^\[rank\d+\]:\s?"),
    re.compile(r"^(?:ERROR|WARNING|INFO|DEBUG|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
               r"(?:\[[^\]]*\]|[\w./]+:\d+\]) ?"),
)

def strip_prefixes(line: str) -> str:
    """The line without the quote, timestamp and log prefixes pasted dumps carry (each at most once, in order)."""
    for prefix in _PREFIXES:
        m = prefix.match(line)
        if m is not None:
            line = line[m.end() :]
    return line


def _native(path: str) -> bool:
    return not (path.endswith((".py", ".pyw")) or path.startswith("<") or path.endswith(">"))


def traceback_frame(line: str) -> tuple[Frame, int] | None:
    """A traceback frame line and its indentation (``File "x.py", line 3, in f``: note the comma before "in")."""
    m = _TB_FRAME.match(line)
    if m is None:
        return None
    number = m.group("line")
    return Frame(m.group("func"), m.group("file"), int(number) if number.isdigit() else None), len(m.group("ind"))


def numbered_frame(line: str) -> tuple[int, Frame] | None:
    """(frame number, frame) for a Flight Recorder or gdb frame line; None for anything else."""
    m = _GDB_FRAME.match(line) or _FR_FRAME.match(line)  # gdb first: its frames also say "from lib"
    if m is None:
        return None
    path = m.group("file") or ""
    number = m.group("line")
    native = _native(path) if path and path != "??" else True
    return int(m.group("n")), Frame(m.group("func"), path, int(number) if number else None, native=native)


def gdb_thread(line: str) -> tuple[str, str] | None:
    """(LWP, name) of a gdb ``thread apply all bt`` header."""
    m = _GDB_THREAD.match(line)
    return (m.group("lwp"), m.group("name") or "") if m else None


def kernel_frame(line: str) -> Frame | bool | None:
    """A kernel stack frame; False for an unreliable ``?`` frame (to skip, not to end the stack); None otherwise."""
    line = _DMESG_TS.sub("", line)
    m = _KERNEL.match(line)
    if m is None:
        return None
    if m.group("unsure"):
        return False
    return Frame(m.group("func"), m.group("module") or "kernel", None, native=True)


def kernel_task(line: str) -> tuple[int, str] | None:
    """(pid, comm) of a hung-task report's ``task:python3.11 state:D ... pid:15277`` line."""
    m = _TASK.match(_DMESG_TS.sub("", line))
    return (int(m.group("pid")), m.group("comm")) if m else None


def is_kernel_line(line: str) -> bool:
    """Lines that belong to a kernel stack without being frames: ``Call Trace:``, ``<TASK>``, ``</TASK>``."""
    body = _DMESG_TS.sub("", line).strip()
    return body in ("Call Trace:", "<TASK>", "</TASK>", "<IRQ>", "</IRQ>")


def has_kernel_address(line: str) -> bool:
    return _KERNEL_ADDR.match(line) is not None
