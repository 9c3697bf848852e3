"""`watchdog.host.docker_cli`: each question's argv and timeout, its answer read, and one shape for every failure
(``(None, "docker inspect NAME: Docker's last line")``), through a fake runner; the real runner's missing program."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from watchdog.host import docker_cli

CID = "3f" * 32


class Runner:
    def __init__(self, rc: int, out: str, err: str = "") -> None:
        self.rc, self.out, self.err = rc, out, err
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
        self.calls.append((list(argv), timeout))
        return self.rc, self.out, self.err


def test_the_id_of_a_name() -> None:
    r = Runner(0, f"{CID}\n")
    assert docker_cli.container_id("vllm", r, 5.0) == (CID, "")
    assert r.calls == [(["docker", "inspect", "--type", "container", "--format", "{{.Id}}", "--", "vllm"], 5.0)]
    assert docker_cli.container_id("vllm", Runner(0, "sha256:abc\n")) == (
        None, "docker inspect vllm: not a container id: 'sha256:abc'")


def test_the_name_of_an_id() -> None:
    r = Runner(0, "/llm\n")
    assert docker_cli.container_name(CID, r, 15.0) == ("llm", "")
    assert r.calls[0] == (["docker", "inspect", "--type", "container", "--format", "{{.Name}}", "--", CID], 15.0)
    assert docker_cli.container_name(CID, Runner(0, "/\n")) == (None, f"docker inspect {CID}: no name")


def test_the_published_port() -> None:
    r = Runner(0, "0.0.0.0:18000\n[::]:18000\n")
    assert docker_cli.published_port(CID, 8000, r, 15.0) == (18000, "")
    assert r.calls == [(["docker", "port", CID, "8000/tcp"], 15.0)]
    assert docker_cli.published_port(CID, 8000, Runner(0, "")) == (None, f"docker port {CID} 8000/tcp: not published")
    assert docker_cli.published_port(CID, 8000, Runner(1, "", "Error: No public port '8000/tcp' published\n")) == (
        None, f"docker port {CID} 8000/tcp: Error: No public port '8000/tcp' published")


@pytest.mark.parametrize(("rc", "out", "err", "why"), [
    (1, "", "Error response from daemon: x\nError: No such container: gone\n",
     "docker inspect gone: Error: No such container: gone"),  # Docker's last line
    (1, "partial\n", "", "docker inspect gone: partial"),  # nothing on stderr: stdout says it
    (124, "", "", "docker inspect gone: exit status 124"),
    (127, "", "program not found: docker", "docker inspect gone: program not found: docker"),
])
def test_every_failure_has_one_shape(rc: int, out: str, err: str, why: str) -> None:
    for ask in (docker_cli.container_id, docker_cli.container_name, docker_cli.container_pid):
        assert ask("gone", Runner(rc, out, err)) == (None, why)


def test_the_real_runner_says_when_the_program_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = "no-such-docker-for-the-watchdog"
    monkeypatch.setattr(docker_cli, "DOCKER", missing)
    assert docker_cli.container_pid("c") == (None, f"docker inspect c: program not found: {missing}")


def test_the_logs_argv() -> None:
    assert docker_cli.logs_argv("vllm-0", 20) == ["docker", "logs", "--tail", "20", "vllm-0"]
