"""Paths in another mount namespace: when /proc/PID/root is used, and the safe opening under a root (a real temp
directory stands in for /proc/PID/root) with hostile links: nothing is reached outside the root."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from watchdog.act.shm_sweep import LocalShm
from watchdog.evidence.collect.context import LogSource, log_tail
from watchdog.evidence.gpu import fr_trigger
from watchdog.evidence.gpu.flight_recorder import FrConfig
from watchdog.host.files import UnsafeFile, list_dir, lstat_at, read_capped, read_tail, unlink_at, write_fifo
from watchdog.host.ns_paths import host_path, root_of
from watchdog.nodes.shm import remove_stale, shm_segments

# ---------------------------------------------------------------------------------------------- root_of


def test_root_of_compares_mount_namespaces(tmp_path: Path) -> None:
    for pid, ns in (("self", "mnt:[4026531841]"), ("10", "mnt:[4026531841]"), ("20", "mnt:[4026532999]")):
        (tmp_path / pid / "ns").mkdir(parents=True)
        os.symlink(ns, tmp_path / pid / "ns" / "mnt")
    assert root_of(10, str(tmp_path)) is None  # ours: the host's paths, as before
    assert root_of(20, str(tmp_path)) == f"{tmp_path}/20/root"
    assert root_of(30, str(tmp_path)) is None  # cannot tell (gone, or not ours to read): the host's path
    assert root_of(None, str(tmp_path)) is None
    assert root_of(os.getpid()) is None  # the real /proc: this process is in its own namespace


def test_host_path() -> None:
    assert host_path("/tmp/x", None) == "/tmp/x"
    assert host_path("/tmp/x", "/proc/7/root") == "/proc/7/root/tmp/x"
    assert host_path("/tmp/x", "/proc/7/root/") == "/proc/7/root/tmp/x"


# ---------------------------------------------------------------------------------------------- a fake container


@pytest.fixture
def box(tmp_path: Path) -> tuple[Path, Path]:
    """(the container's root, a directory outside it holding the host's "secrets")."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    for d in ("etc", "run/fr", "tmp", "dev/shm", "var"):
        (root / d).mkdir(parents=True)
    outside.mkdir()
    (root / "etc" / "shadow").write_text("container shadow\n")
    (outside / "shadow").write_text("HOST SECRET\n")
    return root, outside


def test_an_absolute_link_resolves_inside_the_root(box: tuple[Path, Path]) -> None:
    root, outside = box
    os.symlink("/etc", root / "tmp" / "etc-link")
    assert read_capped("/tmp/etc-link/shadow", 1000, root=str(root)) == b"container shadow\n"
    os.symlink(str(outside), root / "tmp" / "out")  # the host's absolute name of the outside: inside, it is absent
    with pytest.raises(FileNotFoundError):
        read_capped("/tmp/out/shadow", 1000, root=str(root))


def test_dotdot_is_clamped_at_the_root(box: tuple[Path, Path]) -> None:
    root, _ = box
    os.symlink("../../../../../../../../outside", root / "tmp" / "up")  # from the real tmp dir this reaches outside/
    with pytest.raises(FileNotFoundError):  # ... but inside the root it is /outside, which does not exist
        read_capped("/tmp/up/shadow", 1000, root=str(root))
    os.symlink("../../../../etc", root / "tmp" / "up-etc")
    assert read_capped("/tmp/up-etc/shadow", 1000, root=str(root)) == b"container shadow\n"
    assert read_capped("/../../../etc/shadow", 1000, root=str(root)) == b"container shadow\n"


def test_the_last_component_is_never_followed(box: tuple[Path, Path]) -> None:
    root, outside = box
    os.symlink("/etc/shadow", root / "tmp" / "log")
    os.symlink(str(outside / "shadow"), root / "tmp" / "log2")
    for name in ("/tmp/log", "/tmp/log2"):
        with pytest.raises(UnsafeFile, match="symbolic link"):
            read_tail(name, 1000, root=str(root))


def test_links_that_loop_or_lead_to_a_file(box: tuple[Path, Path]) -> None:
    root, _ = box
    os.symlink("/tmp/b", root / "tmp" / "a")
    os.symlink("/tmp/a", root / "tmp" / "b")
    with pytest.raises(UnsafeFile, match="too many symbolic links"):
        read_capped("/tmp/a/x", 10, root=str(root))
    os.symlink("/etc/shadow", root / "tmp" / "file-as-dir")
    with pytest.raises(UnsafeFile, match="not a directory"):
        read_capped("/tmp/file-as-dir/x", 10, root=str(root))
    with pytest.raises(UnsafeFile, match="not an absolute path"):
        read_capped("etc/shadow", 10, root=str(root))


def test_caps_and_checks_still_hold_under_a_root(box: tuple[Path, Path]) -> None:
    root, _ = box
    (root / "tmp" / "big").write_bytes(b"x" * 100)
    with pytest.raises(UnsafeFile, match="more than 10 bytes"):
        read_capped("/tmp/big", 10, root=str(root))
    assert read_tail("/tmp/big", 7, root=str(root)) == b"x" * 7
    os.link(root / "etc" / "shadow", root / "tmp" / "hard")
    with pytest.raises(UnsafeFile, match="hard links"):
        read_capped("/tmp/hard", 1000, root=str(root))
    with pytest.raises(UnsafeFile, match="owned by uid"):
        read_capped("/tmp/big", 1000, owners={os.getuid() + 1}, root=str(root))
    with pytest.raises(UnsafeFile) as err:
        read_capped("/tmp/big", 10, root=str(root))
    assert str(root) in str(err.value)  # the message names where on the host it was


def test_fifo_listing_stat_and_unlink_under_a_root(box: tuple[Path, Path]) -> None:
    root, outside = box
    os.symlink("/run", root / "var" / "run")  # as in Debian images
    os.mkfifo(root / "run" / "fr" / "p0.pipe")
    reader = os.open(root / "run" / "fr" / "p0.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_fifo("/var/run/fr/p0.pipe", b"1\n", root=str(root))
        assert os.read(reader, 10) == b"1\n"
    finally:
        os.close(reader)
    assert list_dir("/var/run/fr", str(root)) == ["p0.pipe"]
    assert lstat_at("/var/run/fr/p0.pipe", str(root)).st_ino == os.lstat(root / "run" / "fr" / "p0.pipe").st_ino
    (outside / "victim").write_text("keep")
    (root / "tmp" / "victim").write_text("gone")
    os.symlink(str(outside), root / "tmp" / "o")
    with pytest.raises(FileNotFoundError):
        unlink_at("/tmp/o/victim", str(root))
    unlink_at("/../tmp/victim", str(root))
    assert (outside / "victim").read_text() == "keep" and not (root / "tmp" / "victim").exists()


# ---------------------------------------------------------------------------------------------- the three users


def test_log_tail_looks_inside_the_container_when_not_on_the_host(box: tuple[Path, Path]) -> None:
    root, _ = box
    (root / "tmp" / "engine.log").write_text("a\nb\nc\n")
    text, where, problem = log_tail(LogSource(file="/tmp/engine.log-not-on-host", lines=2, root=str(root)))
    assert problem and "No such file" in problem and where == f"{root}/tmp/engine.log-not-on-host"
    os.rename(root / "tmp" / "engine.log", root / "tmp" / "engine.log-not-on-host")
    text, where, problem = log_tail(LogSource(file="/tmp/engine.log-not-on-host", lines=2, root=str(root)))
    assert (text, where, problem) == ("b\nc\n", f"{root}/tmp/engine.log-not-on-host", "")
    os.unlink(root / "tmp" / "engine.log-not-on-host")
    os.symlink("/etc/shadow", root / "tmp" / "engine.log-not-on-host")
    text, _, problem = log_tail(LogSource(file="/tmp/engine.log-not-on-host", lines=2, root=str(root)))
    assert text == "" and "symbolic link" in problem


def test_shm_segments_in_the_containers_dev_shm(box: tuple[Path, Path]) -> None:
    root, outside = box
    shm = root / "dev" / "shm"
    (shm / "psm_stale").write_bytes(b"s" * 64)
    (shm / "psm_held").write_bytes(b"h" * 32)
    (shm / "other").write_bytes(b"o")
    (outside / "psm_x").write_text("host file")
    os.symlink(str(outside / "psm_x"), shm / "psm_link")  # a link named like a segment: never a segment
    held = open(shm / "psm_held", "rb")  # noqa: SIM115 - held open across the listing
    try:
        segs = shm_segments("/dev/shm", str(root))
        assert [(s.name, s.size, s.stale) for s in segs] == [("psm_held", 32, False), ("psm_stale", 64, True)]
        assert segs[1].path == f"{root}/dev/shm/psm_stale" and segs[1].where == "/dev/shm/psm_stale"
        removed, failed = remove_stale(segs)
        assert [s.name for s in removed] == ["psm_stale"] and failed == []
        assert not (shm / "psm_stale").exists() and (shm / "psm_held").exists()
        assert (outside / "psm_x").read_text() == "host file"
    finally:
        held.close()


def test_local_shm_sweeps_the_containers_shm(box: tuple[Path, Path]) -> None:
    root, _ = box
    (root / "dev" / "shm" / "psm_a").write_bytes(b"a" * 10)
    report = LocalShm(remove=True, root=lambda: str(root))()
    assert report.error == "" and report.stale == (("psm_a", 10),) and report.removed == (("psm_a", 10),)
    assert not (root / "dev" / "shm" / "psm_a").exists()
    (root / "dev" / "shm").rename(root / "dev" / "shm-moved")
    os.symlink("/etc", root / "dev" / "shm")  # resolved inside: the container's /etc has no segments
    assert LocalShm(remove=True, root=lambda: str(root))().stale == ()


def test_flight_recorder_paths_resolve_inside_the_container(box: tuple[Path, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root, outside = box
    os.symlink("/run", root / "var" / "run")
    pipe = root / "run" / "fr" / "nccl_trace_rank_0.pipe"
    os.mkfifo(pipe)
    os.mkfifo(outside / "nccl_trace_rank_1.pipe")  # the host's: never written
    os.symlink(str(outside / "nccl_trace_rank_1.pipe"), root / "run" / "fr" / "nccl_trace_rank_1.pipe")
    dump = root / "tmp" / "fr_0"
    got: list[bytes] = []

    fd = os.open(pipe, os.O_RDWR)  # the rank's monitor thread holds its pipe open (read-write: never an EOF)

    def engine_side() -> None:  # it reads a line, then writes its dump
        got.append(os.read(fd, 10))
        dump.write_bytes(b'{"version": "2.10", "entries": []}')

    t = threading.Thread(target=engine_side, daemon=True)
    t.start()
    monkeypatch.setattr(fr_trigger, "root_of", lambda pid: str(root))
    cfg = FrConfig(1000, "/var/run/fr/nccl_trace_rank_", "/tmp/fr_")
    out = fr_trigger.trigger([os.getpid()], settle=5.0, configs={os.getpid(): cfg})
    t.join(timeout=5)
    os.close(fd)
    by_rank = {r.rank: r for r in out.ranks}
    assert got == [b"1\n"]
    assert by_rank[0].error == "" and by_rank[0].data.startswith(b'{"version"')
    assert "symbolic link" in by_rank[1].error and str(root) in by_rank[1].error

