"""What the broadcast ring showed when it was read: the flags of the shared-memory ring EngineCore writes each step
into and its local workers read from (vLLM's ``shm_broadcast.ShmRingBuffer``). Pure data.

Per block: the written flag, and one read flag per local reader (a worker on this node, in local-reader order).
A block written and not read by a reader is a step handed out that that reader never took: with the reader parked in
its poll, the lost wake-up. Nothing here is written to the ring: it is only ever read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RingBlock:
    index: int
    written: bool
    read: tuple[bool, ...]  # one flag per local reader, by local reader rank

    def unread_by(self) -> tuple[int, ...]:
        """The local reader ranks that have not read this written block (empty when it is not written)."""
        return tuple(i for i, r in enumerate(self.read) if not r) if self.written else ()


@dataclass(frozen=True, slots=True)
class Ring:
    """One ring as read. ``error`` says why it could not be read or parsed (then ``blocks`` is empty): a segment or
    a layout the watchdog does not know is said, never guessed."""

    segment: str  # its name in /dev/shm (psm_...)
    node: str = "local"
    writer: str = ""  # the writing process's label (VLLM::EngineCore)
    readers: tuple[str, ...] = ()  # local readers' labels, by local reader rank ("" where not known)
    layout: str = ""  # which code's layout read it ("vllm 0.25-0.32"), "" when none fits
    version: str = ""  # the engine's vLLM version as read ("0.25.1+cpu"), "" when not known
    max_chunks: int = 0
    max_chunk_bytes: int = 0
    blocks: tuple[RingBlock, ...] = ()
    error: str = ""
    t: float = 0.0  # when it was read (the capture's clock)

    @property
    def ok(self) -> bool:
        return not self.error

    def unread(self) -> tuple[RingBlock, ...]:
        """Blocks written and not yet read by every local reader."""
        return tuple(b for b in self.blocks if b.unread_by())

    def reader_name(self, i: int) -> str:
        return self.readers[i] if i < len(self.readers) and self.readers[i] else f"local reader {i}"
