"""The restart's /dev/shm check, one sweeper per node (see `watchdog.act.restart`): list the stale segments a dead
engine left (``psm_*``, ``sem.mp-*`` that no process has open or mapped: `watchdog.nodes.shm`) and remove them
where configured. On this host directly (``restart.remove_shm``); on another node through its agent's ``shm``
verb (the node's ``remove_shm``; its agent must allow removing too). Never raises: a failure is in the report."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from watchdog.act.restart import ShmReport
from watchdog.config.load import Config
from watchdog.config.nodes import LOCAL
from watchdog.nodes.shm import Segment, shm_segments
from watchdog.nodes.transport import NodeError, NodeLink


class LocalShm:
    """This host's /dev/shm."""

    def __init__(self, remove: bool, shm_dir: str = "/dev/shm",  # noqa: S108 - POSIX shared memory
                 segments: Callable[[str], list[Segment]] = shm_segments) -> None:
        self.remove, self.shm_dir, self.segments = remove, shm_dir, segments

    def __call__(self) -> ShmReport:
        try:
            segs = self.segments(self.shm_dir)
        except OSError as e:
            return ShmReport(LOCAL, error=f"cannot list {self.shm_dir}: {e}")
        stale = tuple((s.name, s.size) for s in segs if s.stale)
        removed, errors = [], []
        for s in segs:
            if self.remove and s.stale:
                try:
                    os.unlink(s.path)
                    removed.append((s.name, s.size))
                except FileNotFoundError:  # gone meanwhile: nothing left to free
                    continue
                except OSError as e:
                    errors.append(f"cannot remove {s.path}: {e.strerror}")
        return ShmReport(LOCAL, stale, tuple(removed), sum(1 for s in segs if not s.stale),
                         "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""))


class NodeShm:
    """Another node's /dev/shm through its agent: one ``shm`` call to list, a second to remove when configured
    (the list gives each removed segment's size)."""

    def __init__(self, link: NodeLink, remove: bool) -> None:
        self.link, self.remove, self.node = link, remove, link.node.name

    def __call__(self) -> ShmReport:
        try:
            listed = self.link.call("shm", {"remove": False})
            stale = _stale(listed)
            removed: tuple[tuple[str, int], ...] = ()
            in_use = sum(1 for s in listed.get("segments", ()) if isinstance(s, dict) and s.get("in_use"))
            if self.remove and stale:
                try:
                    gone = self.link.call("shm", {"remove": True})
                except NodeError as e:  # listed but not removed (e.g. its agent.toml does not allow it): say both
                    return ShmReport(self.node, stale, (), in_use, f"on node {self.node}: not removed: {e.message}")
                sizes = dict(stale)
                removed = tuple((str(n), sizes.get(str(n), 0)) for n in gone.get("removed", ())
                                if isinstance(n, str))
            return ShmReport(self.node, stale, removed, in_use)
        except NodeError as e:
            return ShmReport(self.node, error=f"on node {self.node}: {e.message}")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            return ShmReport(self.node, error=f"on node {self.node}: a bad shm answer: {e}")


def _stale(answer: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple((str(s["name"]), int(s["bytes"])) for s in answer.get("segments", ())
                 if isinstance(s, dict) and not s.get("in_use"))


def sweepers(cfg: Config, links: dict[str, NodeLink]) -> dict[str, Callable[[], ShmReport]]:
    """One sweeper per node, local first, in config order."""
    out: dict[str, Callable[[], ShmReport]] = {LOCAL: LocalShm(cfg.restart.remove_shm)}
    for n in cfg.nodes:
        out[n.name] = NodeShm(links[n.name], n.remove_shm)
    return out
