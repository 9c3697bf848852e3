"""`watchdog init`: the composed config (pure, from found facts) loads with the real loader and says what it found
and what it could not decide; discovery finds a real `vllm serve`-shaped process listening on its port with an API
key in its environment, naming the variable and never copying the value; an existing file is never overwritten
without --force."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.server import free_port
from watchdog.cli.init import find_servers
from watchdog.cli.main import main
from watchdog.config.load import load
from watchdog.config.starter import HostFound, ServerFound, compose, is_api_server

SERVE = ("/opt/vllm/bin/python", "/opt/vllm/bin/vllm", "serve", "/models/x", "--port", "8123", "--host", "0.0.0.0")


def loads(text: str, tmp_path: Path) -> object:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load(str(p))


def test_a_systemd_served_engine_gets_its_url_unit_log_key_and_restart(tmp_path: Path) -> None:
    s = ServerFound(41, (*SERVE, "--api-key", "s3cret"), (("0.0.0.0", 8123),), unit="vllm.service")
    st = compose(HostFound((s,), gpus=8))
    cfg = loads(st.text, tmp_path)
    assert cfg.engine.url == "http://127.0.0.1:8123"  # type: ignore[attr-defined]
    assert cfg.capture.journal_unit == "vllm.service" and cfg.probe.api_key_env == "VLLM_API_KEY"  # type: ignore
    steps = cfg.restart.steps  # type: ignore[attr-defined]
    assert [(x.kind, x.verb, x.units) for x in steps] == [("systemd", "restart", ("vllm.service",))]
    assert "s3cret" not in st.text and "s3cret" not in " ".join(st.found + st.undecided).replace(
        " ".join(s.argv)[:200], "")
    assert any("8 GPU" in f for f in st.found) and not any("restart" in u for u in st.undecided)


def test_a_docker_engine_gets_the_published_port_and_a_docker_step(tmp_path: Path) -> None:
    s = ServerFound(7, ("python3", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"), container="llm",
                    published_port=18000, api_key_env=True)
    st = compose(HostFound((s,), gpus=None, gpu_note="nvidia-ml-py is not installed"))
    cfg = loads(st.text, tmp_path)
    assert cfg.engine.url == "http://127.0.0.1:18000" and cfg.capture.docker_container == "llm"  # type: ignore
    assert cfg.restart.steps[0].containers == ("llm",)  # type: ignore[attr-defined]
    assert any("nvidia-ml-py" in u for u in st.undecided) and any("VLLM_API_KEY" in f for f in st.found)


def test_nothing_found_or_several_found_says_so_and_still_loads(tmp_path: Path) -> None:
    none = compose(HostFound((), gpus=0))
    cfg = loads(none.text, tmp_path)
    assert cfg.restart.steps == () and cfg.gpu.enabled is False  # type: ignore[attr-defined]
    assert any("no vLLM API server" in u for u in none.undecided)
    assert any("restart" in u for u in none.undecided)
    two = compose(HostFound((ServerFound(1, SERVE), ServerFound(2, (*SERVE[:5], "8124")))))
    assert any("2 vLLM API servers" in u and "--url" in u for u in two.undecided)
    picked = compose(HostFound((ServerFound(1, SERVE, unit="a.service"), ServerFound(2, (*SERVE[:5], "8124"),
                                                                                      unit="b.service")),
                               url="http://10.0.0.1:8124"))
    cfg = loads(picked.text, tmp_path)
    assert cfg.engine.url == "http://10.0.0.1:8124" and cfg.capture.journal_unit == "b.service"  # type: ignore


@pytest.mark.parametrize(("argv", "yes"), [(SERVE, True), (("vllm", "serve", "m"), True),
                                           (("python", "-m", "vllm.entrypoints.cli.main", "serve", "m"), True),
                                           (("vllm", "serve", "m", "--headless"), False),
                                           (("VLLM::EngineCore",), False), (("python", "serve.py"), False)])
def test_what_counts_as_an_api_server(argv: tuple[str, ...], yes: bool) -> None:
    assert is_api_server(argv) is yes


@pytest.fixture
def fake_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    code = (f"import socket, time\ns = socket.socket()\ns.bind(('127.0.0.1', {port}))\ns.listen()\n"
            "print('up', flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen(["bash", "-c", f'exec -a vllm {sys.executable} -c "$0" serve m --port {port}', code],
                         env={**os.environ, "VLLM_API_KEY": "not-for-copying"}, stdout=subprocess.PIPE,
                         start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        yield p, port
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def test_a_real_process_is_found_with_its_port_and_key_name(fake_server: tuple[subprocess.Popen[bytes], int],
                                                            tmp_path: Path) -> None:
    proc, port = fake_server
    mine = [s for s in find_servers() if s.pid == proc.pid]
    assert len(mine) == 1 and ("127.0.0.1", port) in mine[0].listening and mine[0].api_key_env
    out = tmp_path / "etc" / "config.toml"
    assert main(["init", "--url", f"http://127.0.0.1:{port}", "--config", str(out)]) == 0
    text = out.read_text()
    assert f"127.0.0.1:{port}" in text and 'api_key_env = "VLLM_API_KEY"' in text
    assert "not-for-copying" not in text


def test_init_never_overwrites_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "config.toml"
    out.write_text("# mine\n")
    assert main(["init", "--url", "http://127.0.0.1:9", "--config", str(out)]) == 1
    assert out.read_text() == "# mine\n" and "--force" in capsys.readouterr().err
    assert main(["init", "--url", "http://127.0.0.1:9", "--config", str(out), "--print"]) == 0
    printed = capsys.readouterr()
    assert "[engine]" in printed.out and "could not decide" in printed.err and out.read_text() == "# mine\n"
    t0 = time.time()
    assert main(["init", "--url", "http://127.0.0.1:9", "--config", str(out), "--force"]) == 0
    assert out.stat().st_mtime >= t0 - 1 and 'url = "http://127.0.0.1:9"' in out.read_text()
