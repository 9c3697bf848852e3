"""The agent's reading of a request, generated (hypothesis): random and adversarial requests (commands that are no
verb, bytes that are no JSON, JSON nested too deep, NaN, keys given twice, unknown keys, wrong types, values out of
range, argv the node does not allow, pids that are not its engine's, requests too big, half sent and never closed)
never crash the agent, never run anything, and always get exactly one JSON refusal within the request deadline,
with one ``refused`` audit record. The session is the real one (`agent.serve`: its request read from a real pipe);
a few of the worst inputs also go through the agent as sshd starts it (a process of its own).

Also: the argument rules themselves (`requests.check_args`) and the JSON reader (`protocol.load_json`, `depth`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from tests.harness.hostile import run_agent
from watchdog.nodes import agent as agent_module
from watchdog.nodes.agent import serve
from watchdog.nodes.agent_config import AgentConfig, load_agent_config
from watchdog.nodes.arguments import ARGS, check_args
from watchdog.nodes.protocol import MAX_REQUEST_BYTES, VERBS, ProtocolError, clean, depth, load_json, parse_args

DEADLINE = 0.3  # the request deadline in these runs (seconds)
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "engine-watchdog-hypothesis"))  # not in the checkout


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> AgentConfig:
    d = tmp_path_factory.mktemp("agent-requests")
    p = d / "agent.toml"
    # no process on this machine has this title: a well-formed `stacks` can only be refused
    p.write_text(f'audit_log = "{d}/audit.log"\nprocess_prefix = "WDT-NEVER::"\nremove_shm = false\n'
                 f'request_timeout = {DEADLINE}\n[[steps]]\nkind = "command"\nargv = ["touch", "{d}/ran"]\n')
    return load_agent_config(str(p))


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.got: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.got.append(record)


@pytest.fixture(scope="module")
def audit() -> Iterator[Records]:
    h = Records()
    logger = logging.getLogger("watchdog.agent")
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    yield h
    logger.removeHandler(h)


@pytest.fixture
def nothing_runs() -> Iterator[list[object]]:
    """Every way the agent starts a program, replaced by one that records and refuses."""
    started: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        started.append(args)
        raise AssertionError(f"the agent started a program: {args}")

    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess, "Popen", refuse)
    mp.setattr(os, "fork", refuse)
    mp.setattr(os, "execv", refuse)
    yield started
    mp.undo()


def session(cfg: AgentConfig, command: str | None, body: bytes, hold: bool = False) -> tuple[int, str, float]:
    """One session through `serve`, ``body`` written to a real pipe (kept open when ``hold``)."""
    r, w = os.pipe()

    def feed() -> None:
        # blocks while the agent reads (a body over the pipe's buffer is fed as it reads); OSError: it stopped reading
        with contextlib.suppress(OSError):
            os.write(w, body)
        if not hold:
            os.close(w)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    out = io.StringIO()
    t0 = time.monotonic()
    try:
        rc = serve(cfg, command, r, out)
    finally:
        took = time.monotonic() - t0
        os.close(r)  # a writer still blocked gets EPIPE
        writer.join(5)
        if hold:
            os.close(w)
    return rc, out.getvalue(), took


def one_refusal(out: str) -> dict[str, Any]:
    lines = out.splitlines()
    assert len(lines) == 1, out
    answer = json.loads(lines[0])
    assert answer["ok"] is False and isinstance(answer["error"], str) and answer["error"], answer
    return answer


# ---------------------------------------------------------------- what is generated

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


def _not_a_request(raw: bytes) -> bool:
    if not raw.strip():
        return False  # empty is {}: a request
    try:
        return not isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return True


def _wrong(spec: object) -> st.SearchStrategy[Any]:
    """Values the key's spec must refuse."""
    name = type(spec).__name__
    if name == "Bool":
        return json_values.filter(lambda v: not isinstance(v, bool))
    if name in ("Int", "Num"):
        low, high = spec.low, spec.high  # type: ignore[attr-defined]
        out_of_range = st.integers().filter(lambda v: not low <= v <= high) | st.floats(allow_nan=False).filter(
            lambda v: not low <= v <= high)
        wrong_type = json_values.filter(lambda v: isinstance(v, bool) or not isinstance(v, int | float))
        return out_of_range | wrong_type | (st.floats(low, high).filter(lambda v: v != int(v)) if name == "Int"
                                            else st.nothing())
    if name == "Pids":
        return (json_values.filter(lambda v: not isinstance(v, list))
                | st.lists(st.integers().filter(lambda v: not 0 < v < 1 << 22) | st.booleans() | st.text(),
                           min_size=1, max_size=3))
    if name == "Argv":
        return (json_values.filter(lambda v: not isinstance(v, list)) | st.just([])
                | st.lists(st.integers() | st.none() | st.text(alphabet="\0", min_size=1), min_size=1, max_size=3))
    return (json_values.filter(lambda v: not isinstance(v, dict))
            | st.dictionaries(st.text(max_size=12).filter(lambda k: k not in ("log_file", "journal_unit",
                                                                              "docker_container")),
                              json_values, min_size=1, max_size=2))


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str | None, bytes, bool]:
    """(SSH_ORIGINAL_COMMAND, the request, held open) of a request the agent must refuse."""
    kind = draw(st.sampled_from(["command", "bytes", "deep", "constant", "twice", "unknown", "wrong", "run", "pids",
                                 "big", "half"]))
    verb = draw(st.sampled_from(VERBS))
    if kind == "command":
        command = draw(st.none() | st.text(max_size=40) | st.sampled_from(VERBS).map(lambda v: f"{v} --all")
                       | st.sampled_from(VERBS).map(lambda v: f"{v};id"))
        if command is not None and len(command.split()) == 1 and command.split()[0] in VERBS:
            command = command + " x"
        return command, draw(st.binary(max_size=64)), False
    if kind == "bytes":
        return verb, draw(st.binary(min_size=1, max_size=256).filter(_not_a_request)), False
    if kind == "deep":
        n = draw(st.integers(17, 20000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return verb, ('{"x": ' + opener * n + "1" + closer * n + "}").encode(), False
    if kind == "constant":
        return verb, f'{{"x": {draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))}}}'.encode(), False
    if kind == "twice":
        key = draw(st.sampled_from(list(ARGS[verb]) or ["x"]))
        return verb, f'{{"{key}": 1, "{key}": 2}}'.encode(), False
    if kind == "unknown":
        extra = draw(st.dictionaries(st.text(max_size=10).filter(lambda k: k not in ARGS[verb]), json_values,
                                     min_size=1, max_size=3))
        return verb, json.dumps(extra).encode(), False
    if kind == "wrong":
        verb = draw(st.sampled_from([v for v in VERBS if ARGS[v]]))
        key = draw(st.sampled_from(list(ARGS[verb])))
        return verb, json.dumps({key: draw(_wrong(ARGS[verb][key]))}).encode(), False
    if kind == "run":  # well formed, but no argv this node allows
        argv = draw(st.lists(st.text(max_size=20).filter(lambda s: "\0" not in s), min_size=1, max_size=4))
        return "run", json.dumps({"argv": argv, "timeout": 5}).encode(), False
    if kind == "pids":  # well formed, but not this node's engine processes
        pids = draw(st.lists(st.integers(1, (1 << 22) - 1), min_size=1, max_size=5))
        return "stacks", json.dumps({"pids": pids, "rounds": 1, "gap": 0}).encode(), False
    if kind == "big":
        return verb, b'{"x": "' + b"a" * (MAX_REQUEST_BYTES + draw(st.integers(1, 4096))) + b'"}', False
    full = json.dumps({"x": draw(json_values)}).encode()
    return verb, full[: draw(st.integers(0, len(full) - 1))], True  # half a request, never closed


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(request=hostile())
def test_hostile_requests_get_one_json_refusal_in_time_and_run_nothing(
        cfg: AgentConfig, audit: Records, nothing_runs: list[object], request: tuple[str | None, bytes, bool]) -> None:
    command, body, hold = request
    before = len(audit.got)
    rc, out, took = session(cfg, command, body, hold)
    one_refusal(out)
    assert rc == 2, out
    assert took < DEADLINE + 2.0
    assert nothing_runs == []
    events = [r.getMessage() for r in audit.got[before:]]
    assert events == ["session", "refused"], events


@pytest.mark.parametrize(("verb", "body"), [
    ("stacks", b'{"pids": ' + b"[" * 100000 + b"]" * 100000 + b"}"),  # over the size cap too
    ("stacks", b'{"pids": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("list", b"\xff\xfe{\x00"),
    ("run", b'{"argv": ["touch", "x"], "argv": ["touch", "y"]}'),
    ("context", b'{"lines": NaN}'),
    ("version;id", b""),
], ids=["deep-and-big", "deep", "not-utf8", "twice", "nan", "not-a-verb"])
def test_the_worst_requests_through_the_real_process(tmp_path: Path, verb: str, body: bytes) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'audit_log = "{tmp_path}/audit.log"\nrequest_timeout = 2.0\n')
    rc, out, err, took = run_agent(cfg, verb, body)
    assert rc == 2 and took < 30, err[-2000:]
    one_refusal(out)
    got = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines()]
    assert [r["event"] for r in got] == ["session", "refused"]
    assert "Traceback" not in err


def test_an_agent_failure_is_still_one_json_answer(cfg: AgentConfig, audit: Records,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside a verb (discovery raising, here) is the agent's failure, said in one JSON answer, not a trace."""
    def broken(*a: object, **k: object) -> list[object]:
        raise RuntimeError("broken /proc")

    monkeypatch.setattr(agent_module, "discover", broken)
    rc, out, _ = session(cfg, "list", b"{}")
    assert rc == 70 and "the agent failed: RuntimeError: broken /proc" in one_refusal(out)["error"]
    assert audit.got[-1].getMessage() == "failed"


# ---------------------------------------------------------------- the rules themselves


def test_check_args_types_ranges_and_defaults() -> None:
    assert check_args("stacks", {}) == {"pids": (), "rounds": 2, "gap": 3.0, "timeout": None, "native": False,
                                        "locals": False}
    assert check_args("stacks", {"pids": [5], "rounds": 5, "gap": 0, "native": True})["pids"] == (5,)
    assert check_args("context", {"lines": 0})["lines"] == 0
    assert check_args("run", {"argv": ["a", "b"]})["argv"] == ("a", "b")
    for verb, args, says in [
        ("shm", {"remove": "false"}, "remove must be true or false"),
        ("shm", {"remove": 0}, "remove must be true or false"),
        ("stacks", {"rounds": 2.0}, "rounds must be a whole number"),
        ("stacks", {"rounds": 6}, "rounds must be a whole number in 1..5"),
        ("stacks", {"gap": float("inf")}, "gap must be a number"),
        ("stacks", {"pids": [0]}, "pids must be a list"),
        ("stacks", {"pids": [True]}, "pids must be a list"),
        ("stacks", {"pids": list(range(1, 1100))}, "pids must be a list of at most 1024"),
        ("run", {}, "argv is required"),
        ("run", {"argv": []}, "argv must be a list of 1 to 256"),
        ("run", {"argv": ["a\0b"]}, "no NUL"),
        ("context", {"log": {"log_file": "a", "journal_unit": "b"}}, "log must be an object"),
        ("version", {"x": 1}, "version: unknown argument 'x' (it takes: none)"),
    ]:
        with pytest.raises(ProtocolError, match=says.replace("(", r"\(").replace(")", r"\)")):
            check_args(verb, args)


def _depth_by_hand(text: str) -> int:
    """The nesting, one character at a time: what `depth` must say of any text."""
    deepest = level = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    return deepest


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet='[]{}"\\a,:\n', max_size=60) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n', max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(alphabet='[]"\\k', max_size=4), kids,
                                                               max_size=3)).map(json.dumps))
def test_depth_is_the_nesting_of_any_text(text: str) -> None:
    assert depth(text) == _depth_by_hand(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40), st.sampled_from(["", "\n\t"]))
def test_clean_replaces_every_control_character_and_keeps_the_rest(text: str, keep: str) -> None:
    want = "".join("\ufffd" if (ord(c) < 32 or 127 <= ord(c) < 160) and c not in keep else c for c in text[:20])
    assert clean(text, 20, keep) == want


def test_json_reader_limits() -> None:
    assert depth('{"a": "[[[[[[", "b": [1, [2]]}') == 3  # brackets inside strings do not count
    assert depth('"\\"[["') == 0
    assert load_json(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    for raw, says in [(b"[" * 17 + b"]" * 17, "deeper than 16"), (b'{"a": NaN}', "NaN"), (b'{"a": 1, "a": 1}', "twice"),
                      (b"\xff", "not UTF-8"), (b"{", "not JSON")]:
        with pytest.raises(ProtocolError, match=says):
            load_json(raw)
    with pytest.raises(ProtocolError, match="over"):
        parse_args(b" " * (MAX_REQUEST_BYTES + 1))
    assert parse_args(b"  \n") == {}
