"""Docker's command line, asked about one container: its id by name, its name by id, its init pid, the host port
publishing one of its ports; and the argv of its log's tail and of the signals Docker sent it.

Each question is one argv (never a shell) with a timeout, run by a `Runner` (`run_docker` by default:
`watchdog.host.run.run_text`; the tests pass a fake) and answered in one shape: ``(value, "")``, or ``(None, why)``
with the command and Docker's last line of complaint (``docker inspect vllm: Error: No such object: vllm``).
The restart's own ``docker stop|restart|start`` commands are planned in `watchdog.config.restart_plan` and run as
its steps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from watchdog.host.run import run_text

Runner = Callable[[Sequence[str], float], tuple[int, str, str]]  # (argv, timeout) -> (exit status, stdout, stderr)
DOCKER = "docker"
MAX_ANSWER = 64 * 1024  # bytes of stdout, and of stderr, an inspect's answer may take
_ID = re.compile(r"[0-9a-f]{64}")


def run_docker(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """The real `Runner`: ``run_text`` with answers capped at ``MAX_ANSWER``."""
    return run_text(argv, timeout, max_out=MAX_ANSWER, max_err=MAX_ANSWER)


def _failed(what: str, rc: int, out: str, err: str) -> str:
    lines = (err.strip() or out.strip() or f"exit status {rc}").splitlines()
    return f"{what}: {lines[-1][:300]}"


def inspect(target: str, fmt: str, runner: Runner = run_docker, timeout: float = 10.0) -> tuple[str | None, str]:
    """``docker inspect --type container --format FMT -- TARGET``'s answer, stripped."""
    rc, out, err = runner([DOCKER, "inspect", "--type", "container", "--format", fmt, "--", target], timeout)
    if rc != 0:
        return None, _failed(f"docker inspect {target}", rc, out, err)
    return out.strip(), ""


def container_id(name: str, runner: Runner = run_docker, timeout: float = 10.0) -> tuple[str | None, str]:
    """The full (64 hex digits) id of the container named ``name``."""
    out, why = inspect(name, "{{.Id}}", runner, timeout)
    if out is None:
        return None, why
    if not _ID.fullmatch(out):
        return None, f"docker inspect {name}: not a container id: {out[:100]!r}"
    return out, ""


def container_name(cid: str, runner: Runner = run_docker, timeout: float = 10.0) -> tuple[str | None, str]:
    """The name of the container ``cid`` (an id, or its prefix), without Docker's leading ``/``."""
    out, why = inspect(cid, "{{.Name}}", runner, timeout)
    if out is None:
        return None, why
    if not out.lstrip("/"):
        return None, f"docker inspect {cid}: no name"
    return out.lstrip("/"), ""


def container_pid(name: str, runner: Runner = run_docker, timeout: float = 10.0) -> tuple[int | None, str]:
    """The init pid (in this host's pid namespace) of the running container ``name``."""
    out, why = inspect(name, "{{.State.Pid}}", runner, timeout)
    if out is None:
        return None, why
    try:
        pid = int(out)
    except ValueError:
        return None, f"docker inspect {name}: not a pid: {out[:100]!r}"
    if pid <= 0:
        return None, f"container {name} is not running"
    return pid, ""


def published_port(cid: str, port: int, runner: Runner = run_docker,
                   timeout: float = 10.0) -> tuple[int | None, str]:
    """The host port publishing the container's TCP ``port`` (``docker port``: the first of its lines)."""
    rc, out, err = runner([DOCKER, "port", cid, f"{port}/tcp"], timeout)
    if rc != 0:
        return None, _failed(f"docker port {cid} {port}/tcp", rc, out, err)
    for line in out.splitlines():
        tail = line.strip().rsplit(":", 1)[-1]
        if tail.isdigit():
            return int(tail), ""
    return None, f"docker port {cid} {port}/tcp: not published"


def logs_argv(container: str, lines: int) -> list[str]:
    """The command for the last ``lines`` of a container's log (the container's stdout on stdout, stderr on
    stderr)."""
    return [DOCKER, "logs", "--tail", str(lines), container]


def kills_argv(container: str, since: float, until: float) -> tuple[str, ...]:
    """The command for the signals Docker sent ``container`` between two wall times (one per line: 15, then 9
    when it killed)."""
    return (DOCKER, "events", "--since", f"{since:.3f}", "--until", f"{until:.3f}", "--filter",
            f"container={container}", "--filter", "event=kill", "--format", "{{.Actor.Attributes.signal}}")
