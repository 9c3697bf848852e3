"""What NCCL's RAS service says about a job, read from its STATUS answer. Pure: text in, a ``RasStatus`` out.

``parse_ras`` reads the versions, the job summary, the communicators table (status and errors per group), and the
``Errors`` / ``Warnings`` sections, from which it lifts missing ranks and collective-count mismatches for the
cross-rank verdict. Asking RAS (the socket) is `watchdog.evidence.gpu.nccl_ras`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RasComm:
    group: int
    status: str  # RUNNING, INIT, FINALIZE, ABORT, or several joined
    errors: str  # OK, MISMATCH, ERROR, INCOMPLETE, ...
    ranks: int | None  # ranks per communicator
    row: str


@dataclass(frozen=True, slots=True)
class RasBlock:
    """One communicator's entry under Errors or Warnings: ``#0-0 (8a57a4b1fa4104f4) MISMATCH`` and its lines."""

    comm: str
    kind: str  # MISMATCH, INCOMPLETE, ERROR, ...
    lines: tuple[str, ...]
    launched: dict[int, int] = field(default_factory=dict)  # rank -> "has launched up to operation N"

    def behind(self) -> list[int]:
        """Ranks that launched fewer operations than the most advanced one."""
        if not self.launched:
            return []
        top = max(self.launched.values())
        return sorted(r for r, n in self.launched.items() if n < top)


@dataclass(frozen=True, slots=True)
class RasStatus:
    nccl_version: str = ""
    cuda: str = ""
    nodes: int | None = None
    processes: int | None = None
    gpus: int | None = None
    communicators: tuple[RasComm, ...] = ()
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    missing_ranks: tuple[str, ...] = ()  # lines that say ranks are missing / not responding
    mismatches: tuple[str, ...] = ()  # lines that say operation counts or status differ between ranks
    problems: tuple[str, ...] = field(default_factory=tuple)
    blocks: tuple[RasBlock, ...] = ()

    @property
    def healthy(self) -> bool:
        return (bool(self.communicators) and not self.errors and not self.missing_ranks and not self.mismatches
                and all(c.errors == "OK" for c in self.communicators))

    def verdict(self) -> str:
        """One sentence for the cross-rank verdict."""
        if self.missing_ranks:
            return f"NCCL RAS: ranks missing: {'; '.join(self.missing_ranks[:3])}"
        behind = [b for b in self.blocks if b.behind()]
        if behind:
            b = behind[0]
            top = max(b.launched.values())
            late = ", ".join(f"rank {r} at {b.launched[r]}" for r in b.behind())
            return f"NCCL RAS: communicator {b.comm} {b.kind}: {late} while others launched up to operation {top}"
        if self.mismatches:
            return f"NCCL RAS: ranks disagree: {'; '.join(self.mismatches[:3])}"
        bad = [c for c in self.communicators if c.errors != "OK"]
        if bad:
            return "NCCL RAS: " + "; ".join(f"group {c.group} {c.status} {c.errors}" for c in bad[:3])
        if self.errors:
            return f"NCCL RAS errors: {'; '.join(self.errors[:3])}"
        if not self.communicators:
            return "NCCL RAS answered but listed no communicator"
        n = len(self.communicators)
        return f"NCCL RAS: {n} communicator group{'s' if n > 1 else ''}, all ranks present, no errors"


_VERSION = re.compile(r"NCCL version\s+(\S+)(?:\s+compiled with CUDA\s+(\S+))?")
_SECTION = re.compile(r"^(Job summary|Communicators|Errors|Warnings)\b")
_MISSING = re.compile(r"missing|not responding|unresponsive|dead|unreachable|timed? ?out|NOCOMM", re.IGNORECASE)
_MISMATCH = re.compile(r"mismatch|inconsistent|differ|operation count|collective count|outlier", re.IGNORECASE)
_BLOCK = re.compile(r"^#(\S+)\s+\(([0-9a-f]+)\)\s+(\S+)")
_LAUNCHED = re.compile(r"Rank ([0-9]{1,9}) has launched up to operation ([0-9]{1,18})(?![0-9])")
_NUMBER = re.compile(r"(?<![0-9A-Za-z_])[0-9]{1,18}(?![0-9A-Za-z_])")  # ASCII digits, and no 5000-digit int()
_STATUS_WORDS = {"RUNNING", "INIT", "FINALIZE", "ABORT", "NOCOMM"}


def _ints(line: str) -> list[int]:
    return [int(x) for x in _NUMBER.findall(line)]


def _count(word: str) -> bool:
    return bool(re.fullmatch(r"[0-9]{1,9}", word))


def parse_ras(text: str) -> RasStatus:
    """Read a RAS STATUS answer. Tolerant: unknown lines are kept under errors/warnings as they appear. The answer
    comes from whatever listens on the RAS port (any local user may): numbers are ASCII digits, 18 at most (a
    5000-digit one or a unicode digit cannot raise), and the reading is linear in the text."""
    version = cuda = ""
    m = _VERSION.search(text)
    if m:
        version, cuda = m.group(1), m.group(2) or ""
    sections: dict[str, list[str]] = {}
    current = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        head = _SECTION.match(line.strip())
        if head and not line.startswith(" "):
            current = head.group(1)
            sections.setdefault(current, [])
            continue
        if current and line.strip() and not set(line.strip()) <= {"=", "-"}:
            sections[current].append(line)
    nodes = processes = gpus = None
    job = sections.get("Job summary", [])
    numeric = [ln for ln in job if re.fullmatch(r"[\s0-9]+", ln)]
    if numeric:  # columns: nodes, processes per node, GPUs per process, processes total, GPUs total
        vals = _ints(numeric[0])
        if len(vals) >= 5:
            nodes, processes, gpus = vals[0], vals[3], vals[4]
    comms = []
    for ln in sections.get("Communicators", []):
        words = ln.split()
        if not words or not _count(words[0]):
            continue
        status = next((w for w in words if w.split(",")[0] in _STATUS_WORDS), "")
        errs = words[-1] if status and words[-1] != status else ""
        nums = [int(w) for w in words if _count(w)]
        comms.append(RasComm(int(words[0]), status, errs, nums[4] if len(nums) > 4 else None, ln.strip()))
    errors = tuple(ln.strip() for ln in sections.get("Errors", []))
    warnings = tuple(ln.strip() for ln in sections.get("Warnings", []))
    both = errors + warnings
    missing = tuple(ln for ln in both if _MISSING.search(ln))
    seen_missing = set(missing)
    mismatches = tuple(ln for ln in both if _MISMATCH.search(ln) and ln not in seen_missing)
    # (comm, kind, lines, launched) gathered in lists, frozen once: a block of many lines costs no more than its lines
    found: list[tuple[str, str, list[str], dict[int, int]]] = []
    for ln in both:
        head = _BLOCK.match(ln)
        if head:
            found.append((f"{head.group(1)} ({head.group(2)})", head.group(3), [ln], {}))
        elif found:
            found[-1][2].append(ln)
            m2 = _LAUNCHED.search(ln)
            if m2:
                found[-1][3][int(m2.group(1))] = int(m2.group(2))
    blocks = [RasBlock(comm, kind, tuple(lines), launched) for comm, kind, lines, launched in found]
    problems = () if comms or "Communicators" in sections else ("no communicators section in the RAS answer",)
    return RasStatus(version, cuda, nodes, processes, gpus, tuple(comms), errors, warnings, missing, mismatches,
                     problems, tuple(blocks))
