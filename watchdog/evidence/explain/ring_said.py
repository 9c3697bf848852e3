"""What a broadcast ring shows, in words and as JSON. Pure: `watchdog.core.ring.Ring` in, a sentence or a dict out.

`said(ring)`: one sentence ("ring psm_ab12 (vllm 0.25-0.32 layout, 10 blocks, 2 local readers): block 4 written,
read by Worker_TP1, not by Worker_TP0"); `said_all(rings)`: the bundle's one line; `ring_to_dict`: ring.json's
entry and the agent's answer. The flags are a snapshot: a block written and not yet read is also what a step in
progress looks like; the verdict weighs it with the stacks (a parked reader) and the metrics (work pending).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from watchdog.core.ring import Ring, RingBlock

MAX_BLOCKS_SAID = 4  # more unread blocks than this are counted, not each said


def _where(ring: Ring) -> str:
    return ring.segment if ring.node == "local" else f"{ring.segment} on node {ring.node}"


def _names(ring: Ring, ranks: Sequence[int]) -> str:
    return ", ".join(ring.reader_name(i) for i in ranks)


def _block(ring: Ring, b: RingBlock) -> str:
    unread = b.unread_by()
    read = [i for i, r in enumerate(b.read) if r]
    if not read:
        return f"block {b.index} written, read by none of its {len(b.read)} local readers ({_names(ring, unread)})"
    return f"block {b.index} written, read by {_names(ring, read)}, not by {_names(ring, unread)}"


def said(ring: Ring) -> str:
    """One sentence: what the ring's flags show, or why it could not be read."""
    name = _where(ring) if ring.segment else "ring"
    if ring.error:
        where = f"ring {name}: " if ring.segment else (f"node {ring.node}: " if ring.node != "local" else "")
        return where + ring.error
    n = len(ring.readers) or (len(ring.blocks[0].read) if ring.blocks else 0)
    head = f"ring {name} ({ring.layout} layout, {len(ring.blocks)} blocks, {n} local reader{'s' * (n != 1)})"
    written = [b for b in ring.blocks if b.written]
    if not written:
        return f"{head}: no block written yet"
    unread = ring.unread()
    if not unread:
        return f"{head}: every written block read by every reader ({len(written)} written)"
    parts = [_block(ring, b) for b in unread[:MAX_BLOCKS_SAID]]
    if len(unread) > MAX_BLOCKS_SAID:
        parts.append(f"{len(unread) - MAX_BLOCKS_SAID} more blocks written and not read by all")
    return f"{head}: " + "; ".join(parts)


def said_all(rings: Sequence[Ring]) -> str:
    """The bundle's line: every ring's sentence, or that none was read."""
    if not rings:
        return "not read (no EngineCore with local workers in the capture)"
    return " | ".join(said(r) for r in rings)


def ring_to_dict(ring: Ring) -> dict[str, Any]:
    return {"segment": ring.segment, "node": ring.node, "writer": ring.writer, "readers": list(ring.readers),
            "layout": ring.layout, "version": ring.version, "max_chunks": ring.max_chunks,
            "max_chunk_bytes": ring.max_chunk_bytes,
            "blocks": [{"index": b.index, "written": b.written, "read": list(b.read),
                        "unread_by": [ring.reader_name(i) for i in b.unread_by()]} for b in ring.blocks],
            "error": ring.error, "t": ring.t, "said": said(ring)}


def ring_readers(rings: tuple[Ring, ...]) -> dict[str, int | None] | None:
    """The rings' local readers by name, each with the first block written and not read by it (None: it read every
    block written); None when no ring was read."""
    if not rings:
        return None
    out: dict[str, int | None] = {}
    for ring in rings:
        n = len(ring.readers) or (len(ring.blocks[0].read) if ring.blocks else 0)
        for i in range(n):
            first = next((b.index for b in ring.blocks if i in b.unread_by()), None)
            name = ring.reader_name(i)
            out[name] = first if out.get(name) is None else out[name]
    return out
