"""``watchdog init [--url URL] [--config PATH] [--print] [--force]``: a starting config from what this host shows.

It looks for a vLLM API server process (``vllm serve``, not headless; or the OpenAI server module) in /proc: its
command line (--port, --host, --api-key's presence), the sockets it listens on, its cgroup (a systemd service or a
Docker container, and then the port Docker publishes), whether ``VLLM_API_KEY`` is in its environment (the name
only: no value is read into anything), and counts the GPUs through NVML. `watchdog.config.starter` writes the text;
the real loader checks it; it is written to ``--config`` (default ``$ENGINE_WATCHDOG_CONFIG``, else
/etc/engine-watchdog/config.toml) unless that exists (``--force`` replaces a file, never anything else) or printed
with ``--print``. What was found and what could not be decided go to
stderr (with --print) or stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from watchdog.cli.config import CONFIG_ENV, DEFAULT_CONFIG, config_path
from watchdog.config.load import ConfigError, load
from watchdog.config.starter import HostFound, ServerFound, compose, is_api_server, server_port
from watchdog.host import docker_cli
from watchdog.host.proc_stat import read_stat
from watchdog.host.sockets import held_listeners
from watchdog.nodes.identity import cgroup_paths, docker_id_in, unit_in


def _argv(pid: str, proc: Path) -> tuple[str, ...]:
    raw = (proc / pid / "cmdline").read_bytes()
    return tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def _listening(pid: str, proc: Path) -> tuple[tuple[str, int], ...]:
    """(address, port) of the TCP sockets this process holds open and listening (its own network namespace)."""
    return tuple(sorted({(x.address, x.port) for x in held_listeners(int(pid), proc)}))


def _has_env(pid: str, proc: Path, name: str) -> str | None:
    """The value's presence only: ``""`` when set (the value is dropped at once), None when not."""
    with contextlib.suppress(OSError):
        for entry in (proc / pid / "environ").read_bytes().split(b"\0"):
            if entry.startswith(name.encode() + b"="):
                return "" if name != "VLLM_PROCESS_NAME_PREFIX" else entry.split(b"=", 1)[1].decode(errors="replace")
    return None


def _docker(container_id: str, port: int, notes: list[str]) -> tuple[str, int]:
    """(the container's name, the host port publishing ``port``), as far as docker says."""
    if not shutil.which("docker"):
        notes.append(f"docker is not installed here: container {container_id[:12]} named by its id")
        return container_id[:12], 0
    name, _ = docker_cli.container_name(container_id, timeout=15.0)
    published, _ = docker_cli.published_port(container_id, port, timeout=15.0)
    return name or container_id[:12], published or 0


def find_servers(proc: Path = Path("/proc"), notes: list[str] | None = None) -> tuple[ServerFound, ...]:
    notes = notes if notes is not None else []
    init = ""
    with contextlib.suppress(OSError):
        init = (proc / "1" / "cgroup").read_text()
    out = []
    for d in sorted(proc.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        if not d.name.isdigit():
            continue
        try:
            argv = _argv(d.name, proc)
            if not argv or not is_api_server(argv):
                continue
            paths = cgroup_paths((d / "cgroup").read_text(), init)
        except OSError:
            continue
        container = next((c for c in map(docker_id_in, paths) if c), "")
        unit = "" if container else next((u for u in map(unit_in, paths) if u.endswith(".service")), "")
        s = ServerFound(int(d.name), argv, _listening(d.name, proc), unit, container,
                        api_key_env=_has_env(d.name, proc, "VLLM_API_KEY") is not None,
                        process_prefix=_has_env(d.name, proc, "VLLM_PROCESS_NAME_PREFIX") or "")
        if container:
            name, published = _docker(container, server_port(s), notes)
            s = ServerFound(s.pid, s.argv, s.listening, "", name, published, s.api_key_env, s.process_prefix)
        out.append(s)
    # the API server's children (EngineCore...) carry other titles; a `vllm serve` parent and its re-exec'd child
    # would both match: keep the outermost of a parent/child pair
    pids = {s.pid for s in out}
    return tuple(s for s in out if _parent(s.pid, proc) not in pids)


def _parent(pid: int, proc: Path) -> int:
    st = read_stat(pid, proc)
    return 0 if st is None else st.ppid


def count_gpus() -> tuple[int | None, str]:
    try:
        import pynvml  # type: ignore[import-untyped,unused-ignore]  # noqa: PLC0415 - optional
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()), ""
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        return None, f"NVML cannot be used: {e}"


def add_parser(sub: Any) -> None:
    i = sub.add_parser("init", help="write a starting config from what this host shows (engine URL, unit or "
                                    "container, API key variable, GPUs, restart steps)")
    i.add_argument("--url", default="", help="the engine's base URL, when it cannot be found or several run here")
    i.add_argument("--config", help=f"the file to write (default ${CONFIG_ENV}, else {DEFAULT_CONFIG})")
    i.add_argument("--name", default="vllm", help="how events and metrics name this engine stack")
    i.add_argument("--print", dest="to_stdout", action="store_true", help="print the config, write nothing")
    i.add_argument("--force", action="store_true", help="replace an existing config file")
    i.set_defaults(func=cmd_init)


def cmd_init(args: argparse.Namespace) -> int:
    notes: list[str] = []
    servers = find_servers(notes=notes)
    gpus, why = count_gpus()
    starter = compose(HostFound(servers, gpus, why, args.url, tuple(notes)), args.name)
    target = Path(config_path(args.config).path)
    if not args.to_stdout and target.exists() and not target.is_file():
        print(f"watchdog init: {target} is not a regular file: nothing written (--config PATH names the file)",
              file=sys.stderr)
        return 1
    if not args.to_stdout and target.exists() and not args.force:
        print(f"watchdog init: {target} exists: not overwritten (--force replaces it, --print shows the new text)",
              file=sys.stderr)
        return 1
    here = Path(tempfile.gettempdir()) if args.to_stdout else target.parent
    if not args.to_stdout:
        here.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=here, prefix=".watchdog-init.", suffix=".toml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(starter.text)
        load(tmp)  # the real loader: a text it refuses is a bug here, never written
        if not args.to_stdout:
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
    except ConfigError as e:
        print(f"watchdog init: the composed config does not load (a bug, please report it): {e}", file=sys.stderr)
        return 70
    finally:
        Path(tmp).unlink(missing_ok=True)
    report = sys.stderr if args.to_stdout else sys.stdout
    if args.to_stdout:
        print(starter.text)
    else:
        print(f"wrote {target}", file=report)
    for line in starter.found:
        print(f"found: {line}", file=report)
    for line in starter.undecided:
        print(f"could not decide: {line}", file=report)
    return 0
