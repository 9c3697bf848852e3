"""The restart's /dev/shm check, one sweeper per node (see `watchdog.act.restart`): list the stale segments a dead
engine left (``psm_*``, ``sem.mp-*`` that no process has open or mapped: `watchdog.nodes.shm`) and remove them
where configured. On this host directly (``restart.remove_shm``); on another node through its agent's ``shm``
verb (the node's ``remove_shm``; its agent must allow removing too). Never raises: a failure is in the report.

With ``[capture] docker_container`` named, this host's check looks in that container's own ``/dev/shm`` (through
its init process's ``/proc/PID/root``) when the container runs in another mount namespace; a container that is not
running has no /dev/shm of its own left, and the host's is checked (``--ipc=host`` segments live there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from watchdog.act.restart import ShmReport
from watchdog.config.load import Config
from watchdog.core.processes import LOCAL
from watchdog.evidence.collect.capture import run_argv
from watchdog.host.docker_cli import container_pid
from watchdog.host.ns_paths import root_of
from watchdog.nodes.shm import Segment, remove_segment, shm_segments
from watchdog.nodes.transport import NodeError, NodeLink


def container_root(name: str) -> Callable[[], str | None]:
    """The root of container ``name``'s init process when it runs in another mount namespace (None: use ours)."""
    def root() -> str | None:
        pid, _ = container_pid(name, run_argv)
        return root_of(pid)
    return root


class LocalShm:
    """This host's /dev/shm, or the engine container's (``root``: where the engine's paths are, None for ours)."""

    def __init__(self, remove: bool, shm_dir: str = "/dev/shm",  # noqa: S108 - POSIX shared memory
                 segments: Callable[[str, str | None], list[Segment]] = shm_segments,
                 root: Callable[[], str | None] = lambda: None) -> None:
        self.remove, self.shm_dir, self.segments, self.root = remove, shm_dir, segments, root

    def __call__(self) -> ShmReport:
        root = self.root()
        where = self.shm_dir if root is None else f"{self.shm_dir} (under {root})"
        try:
            segs = self.segments(self.shm_dir, root)
        except OSError as e:
            return ShmReport(LOCAL, error=f"cannot list {where}: {e}")
        stale = tuple((s.name, s.size) for s in segs if s.stale)
        removed, errors = [], []
        for s in segs:
            if self.remove and s.stale:
                try:
                    remove_segment(s)
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


def sweepers(cfg: Config, links: Mapping[str, NodeLink]) -> dict[str, Callable[[], ShmReport]]:
    """One sweeper per node, local first, in config order."""
    name = cfg.capture.docker_container
    out: dict[str, Callable[[], ShmReport]] = {
        LOCAL: LocalShm(cfg.restart.remove_shm, root=container_root(name) if name else lambda: None)}
    for n in cfg.nodes:
        out[n.name] = NodeShm(links[n.name], n.remove_shm)
    return out
