"""A starting config from what `watchdog init` found on this host, pure: the found facts in, the TOML text and what
was found and what could not be decided out. `watchdog.cli.init` does the looking (/proc, cgroups, NVML, docker)
and checks the text with the real loader before writing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

DEFAULT_PORT = 8000  # vllm serve's --port default
WILDCARD = ("", "0.0.0.0", "::", "[::]")  # noqa: S104 - addresses to read as "this host", never bound here


@dataclass(frozen=True, slots=True)
class ServerFound:
    """One vLLM API server process on this host."""

    pid: int
    argv: tuple[str, ...]
    listening: tuple[tuple[str, int], ...] = ()  # (address, port) its sockets listen on
    unit: str = ""  # the systemd service it runs in
    container: str = ""  # the Docker container (name, else id) it runs in
    published_port: int = 0  # the host's port Docker publishes the server's port on (0: not known)
    api_key_env: bool = False  # VLLM_API_KEY is in its environment (only the name was looked at)
    process_prefix: str = ""  # its VLLM_PROCESS_NAME_PREFIX when set


@dataclass(frozen=True, slots=True)
class HostFound:
    servers: tuple[ServerFound, ...] = ()
    gpus: int | None = None  # None: could not tell
    gpu_note: str = ""  # why not, when gpus is None
    url: str = ""  # given with --url
    notes: tuple[str, ...] = ()  # what the looking itself could not do (docker absent, /proc unreadable...)


@dataclass(frozen=True, slots=True)
class Starter:
    text: str
    found: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)


def option(argv: tuple[str, ...], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` (the last one given), None when absent."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1:]
    return value


def is_api_server(argv: tuple[str, ...]) -> bool:
    """``vllm serve ...`` (the `vllm` script or ``-m vllm.entrypoints.cli.main``) not headless, or the OpenAI
    server module."""
    if any("vllm.entrypoints.openai.api_server" in a for a in argv):
        return True
    words = [a.rsplit("/", 1)[-1] for a in argv[:4]]
    return "serve" in argv[:4] and any(w == "vllm" or w.startswith("vllm.entrypoints.cli") for w in words) \
        and "--headless" not in argv


def server_port(s: ServerFound) -> int:
    text = option(s.argv, "--port")
    if text is not None and text.isdigit():
        return int(text)
    return DEFAULT_PORT


def server_url(s: ServerFound) -> str:
    host = option(s.argv, "--host") or ""
    port = s.published_port or server_port(s)
    scheme = "https" if option(s.argv, "--ssl-certfile") else "http"
    host = "127.0.0.1" if host in WILDCARD or s.container else host
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def _s(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _chosen(found: HostFound, say: list[str], undecided: list[str]) -> ServerFound | None:
    servers = found.servers
    if found.url:
        port = found.url.rstrip("/").rsplit(":", 1)[-1]
        mine = [s for s in servers if port.isdigit() and int(port) in
                {server_port(s), s.published_port, *(p for _, p in s.listening)}]
        say.append(f"engine URL {found.url} (given)")
        if len(mine) == 1:
            return mine[0]
        undecided.append(f"no vLLM server process on this host serves port {port}" if not mine else
                         f"{len(mine)} vLLM server processes serve port {port}: unit, container and key not taken "
                         "from any")
        return None
    if len(servers) == 1:
        return servers[0]
    if not servers:
        undecided.append("no vLLM API server process found on this host (started? a worker node runs the agent, "
                         "not this): engine URL left at the default; give --url")
    else:
        undecided.append(f"{len(servers)} vLLM API servers found (pids {', '.join(str(s.pid) for s in servers)}): "
                         "give --url for the one to watch (one watchdog per engine)")
    return None


def compose(found: HostFound, name: str = "vllm") -> Starter:
    say: list[str] = []
    undecided: list[str] = [*found.notes]
    s = _chosen(found, say, undecided)
    url = found.url or (server_url(s) if s else "http://127.0.0.1:8000")
    out = ["# engine-watchdog config written by `watchdog init`; every key not here has its default",
           "# (systemd/config.example.toml lists them all). Review it before starting the service.", "",
           "[engine]", f"url = {_s(url)}", f"name = {_s(name)}", ""]
    if s:
        say.append(f"vLLM API server pid {s.pid}: {' '.join(s.argv)[:200]}")
        if not found.url:
            say.append(f"engine URL {url}" + (f" (Docker publishes its port {server_port(s)} on {s.published_port})"
                                              if s.published_port else ""))
        if s.listening and server_port(s) not in {p for _, p in s.listening}:
            undecided.append(f"pid {s.pid} listens on {', '.join(f'{a}:{p}' for a, p in s.listening)}, not on "
                             f"{server_port(s)}: check the URL")
        if s.container and not s.published_port:
            undecided.append(f"container {s.container}: its published port is not known; the URL assumes the "
                             "server's own port on 127.0.0.1 (give --url otherwise)")
    key = bool(s and (s.api_key_env or option(s.argv, "--api-key") is not None))
    out += ["[probe]"]
    if key and s:
        how = "VLLM_API_KEY in its environment" if s.api_key_env else "--api-key on its command line"
        say.append(f"the server takes an API key ({how}); the value was not read")
        out += ["api_key_env = \"VLLM_API_KEY\"   # give the watchdog the same key in this variable (systemd: "
                "EnvironmentFile=), or api_key_file"]
    else:
        out += ["# api_key_env = \"VLLM_API_KEY\"  # no API key seen; if the server takes one, give it here"]
    out.append("")
    out += ["[capture]"]
    if s and s.process_prefix and s.process_prefix != "VLLM::":
        out.append(f"process_prefix = {_s(s.process_prefix)}")
        say.append(f"process title prefix {s.process_prefix} (VLLM_PROCESS_NAME_PREFIX)")
    if s and s.unit:
        out.append(f"journal_unit = {_s(s.unit)}")
    elif s and s.container:
        out.append(f"docker_container = {_s(s.container)}")
    else:
        out.append("# journal_unit = \"\"     # the engine's log for incidents (or docker_container / log_file)")
        undecided.append("the engine's log: not a systemd unit or Docker container; set capture.log_file if it "
                         "writes one")
    out.append("")
    out += _gpu(found, say, undecided)
    out += _restart(s, say, undecided)
    return Starter("\n".join(out), say, undecided)


def _gpu(found: HostFound, say: list[str], undecided: list[str]) -> list[str]:
    if found.gpus is None:
        undecided.append(f"GPUs: could not tell ({found.gpu_note or 'NVML not usable'}): GPU evidence left on, "
                         "it does nothing without NVML")
        return ["[gpu]", "enabled = true          # GPUs could not be counted here", ""]
    say.append(f"{found.gpus} GPU(s) (NVML)")
    return ["[gpu]", f"enabled = {'true' if found.gpus else 'false'}         # {found.gpus} GPU(s) seen by NVML", ""]


def _restart(s: ServerFound | None, say: list[str], undecided: list[str]) -> list[str]:
    out = ["[restart]"]
    if s and s.unit:
        say.append(f"runs in systemd unit {s.unit}: restart step systemctl restart {s.unit}")
        return [*out, "[[restart.steps]]", 'kind = "systemd"', 'action = "restart"', f"units = [{_s(s.unit)}]", ""]
    if s and s.container:
        say.append(f"runs in Docker container {s.container}: restart step docker restart {s.container}")
        return [*out, "[[restart.steps]]", 'kind = "docker"', 'action = "restart"',
                f"containers = [{_s(s.container)}]", ""]
    undecided.append("how to restart the engine: it runs in no systemd service or Docker container found; no "
                     "restart steps (the watchdog records and alerts only; add [[restart.steps]] to act)")
    return [*out, "# no [[restart.steps]]: the watchdog records and alerts, it does not restart", ""]
