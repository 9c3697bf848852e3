"""The runbook pages (``runbooks/<name>.md``) held to the code they describe, and to a root shell.

One page per `Runbook` value and no page without one; each page has the same four sections; every config key a page
names (``[section] key`` or ``section.key``) is a field of the config dataclasses; every relative link resolves (a
``#anchor`` to a heading of the page it points at); the index (``runbooks/README.md``) links every page and has no
commands of its own.

Their shell (tests/unit/runbook_check.py checks it): one ```sh block at the top of each page sets every variable its
commands use, and one ```sh kubectl block the Kubernetes ones; no placeholder word is left; on the host `watchdog`
and `py-spy` are the install's (``$WATCHDOG``, ``$PYSPY``: not on root's PATH); every watchdog command line parses
with the CLI's own parser, every py-spy line with the options py-spy's --help lists, and every container a kubectl
line names is one of the shipped manifests'. Nothing is run but ``py-spy --help``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from tests.unit.runbook_check import FENCE, PYSPY, manifest_containers, shell_problems, spans, watchdog_problem
from tests.unit.runbook_shell import blocks, pyspy_problem, pyspy_verbs
from watchdog.config.load import Config
from watchdog.core.runbooks import Runbook

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "runbooks"
INDEX = "README.md"
SECTIONS = ("What the watchdog saw", "Confirm by hand", "What to do now", "Keep for the upstream report")
MAX_LINES = 115  # read at 3 a.m.: short (the two variable blocks at the top included)

_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$", re.MULTILINE)
_FILE_SUFFIXES = {"md", "json", "jsonl", "csv", "txt", "toml", "pickle", "log", "py", "service"}


def _pages(where: Path = RUNBOOKS) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(where.glob("*.md"))}


def _fields_of(tp: object) -> tuple[type, bool] | None:
    """(dataclass, is a table) for a Config field's type: a section, or a tuple of them ([[nodes]], [[...steps]])."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp, False
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)[0]
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            return inner, True
    return None


def config_keys() -> dict[str, set[str]]:
    """Every section and table of the config ("judge", "restart.steps", "nodes", ...) with its keys."""
    out: dict[str, set[str]] = {}

    def walk(name: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        out[name] = {f.name for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            found = _fields_of(hints[f.name])
            if found is not None:
                walk(f"{name}.{f.name}", found[0])

    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        found = _fields_of(hints[f.name])
        if found is not None:
            walk(f.name, found[0])
    return out


def config_refs(text: str, sections: set[str]) -> list[tuple[str, str]]:
    """(section, key) for every ``[section] key``, ``[[table]] key`` and ``section.key`` the text names."""
    refs = [(m.group(1), m.group(2)) for m in re.finditer(r"\[\[?([a-z_]+(?:\.[a-z_]+)?)\]\]?[ `]+([a-z_]\w*)", text)
            if m.group(1) in sections]
    names = "|".join(sorted((re.escape(s) for s in sections), key=len, reverse=True))
    for m in re.finditer(rf"(?<![\w./-])({names})\.([a-z_]\w*)(?![\w/-]|\.\w)", text):
        if m.group(2) not in _FILE_SUFFIXES:
            refs.append((m.group(1), m.group(2)))
    return refs


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def broken_links(name: str, text: str) -> list[str]:
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (RUNBOOKS / path).resolve() if path else RUNBOOKS / name
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md":
            anchors = {slug(h) for _, h in _HEADING.findall(file.read_text(encoding="utf-8"))}
            if anchor not in anchors:
                bad.append(f"{target}: no heading #{anchor} in {file.name}")
    return bad


# -- the pages ---------------------------------------------------------------------------------------------------


def test_every_runbook_has_its_page_and_every_page_a_runbook() -> None:
    pages = set(_pages()) - {INDEX}
    wanted = {f"{rb.value}.md" for rb in Runbook}
    assert sorted(wanted - pages) == [], "Runbook values without a page in runbooks/"
    assert sorted(pages - wanted) == [], "pages in runbooks/ that no Runbook value names (remove or name them)"
    for rb in Runbook:
        assert (RUNBOOKS.parent / rb.path).is_file(), rb.path


@pytest.mark.parametrize("rb", list(Runbook), ids=lambda rb: rb.value)
def test_each_page_has_the_four_sections_in_order_and_is_short(rb: Runbook) -> None:
    text = (RUNBOOKS / f"{rb.value}.md").read_text(encoding="utf-8")
    headings = [(len(h), t) for h, t in _HEADING.findall(text)]
    assert headings and headings[0][0] == 1, f"{rb.value}: the page starts with its title (# ...)"
    seconds = [t for level, t in headings if level == 2]
    assert [t for t in seconds if t in SECTIONS] == list(SECTIONS), f"{rb.value}: sections {seconds}"
    for section in SECTIONS:  # each section says something
        body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
        assert len(body.strip()) > 40, f"{rb.value}: section {section!r} is empty"
    assert len(text.splitlines()) <= MAX_LINES, f"{rb.value}: {len(text.splitlines())} lines"


def test_every_shell_line_works_as_pasted_from_the_top_blocks_variables() -> None:
    pages = _pages()
    index = pages.pop(INDEX)  # the index explains the conventions: no command of its own to set variables for
    assert blocks(INDEX, index) == ([], []) and spans(INDEX, index) == [] and "```" not in FENCE.sub("", index)
    check = shell_problems(pages)
    assert check.problems == []
    # enough was read for the check to mean something: every page has its commands, and its kubectl variant
    assert check.parsed["watchdog"] >= 3 * len(Runbook), check.parsed
    assert check.parsed["py-spy"] >= 10, check.parsed
    assert check.parsed["kubectl"] >= 2 * len(Runbook), check.parsed


def test_every_config_key_a_page_names_exists() -> None:
    keys = config_keys()
    bad, seen = [], 0
    for name, text in _pages().items():
        for section, key in config_refs(text, set(keys)):
            seen += 1
            if key not in keys[section]:
                bad.append(f"{name}: {section}.{key} is not a config key")
    assert bad == []
    assert seen >= 10


def test_every_link_resolves_and_the_index_names_every_page() -> None:
    pages = _pages()
    bad = [f"{name}: {b}" for name, text in pages.items() for b in broken_links(name, text)]
    assert bad == []
    index = pages[INDEX]
    linked = {t.partition("#")[0] for t in _LINK.findall(index)}
    assert sorted(f"{rb.value}.md" for rb in Runbook if f"{rb.value}.md" not in linked) == []


# -- the checks themselves can fail --------------------------------------------------------------------------------

GOOD_PAGE = """# Good

```sh
VENV=/opt/engine-watchdog/.venv; WATCHDOG=$VENV/bin/watchdog; PYSPY=$VENV/bin/py-spy
STATE=$("$WATCHDOG" config get state.dir)
PID=$(pgrep -o -f '^VLLM::EngineCore')
```

```sh kubectl
NS=vllm
POD=$(kubectl get pods -n "$NS" -l role=leader -o jsonpath='{.items[0].metadata.name}')
```

## Confirm by hand

```sh
"$WATCHDOG" status --json; ls "$STATE/incidents"
for pid in $(pgrep -f '^VLLM::'); do "$PYSPY" dump --native --pid "$pid"; done > "stacks-$PID.txt" 2>&1
```

```sh kubectl
kubectl exec -n "$NS" "$POD" -c engine-watchdog -- watchdog pause --for 15m --reason "a look"
```

Then `"$WATCHDOG" resume`, as the daemon says: "observe only until `watchdog reset`".
"""

BAD_PAGE = """# Bad

```sh
WATCHDOG=watchdog
echo hello
```

## Confirm by hand

```sh
"$WATCHDOG" show ID --config $CFG
"$WATCHDOG" dump --natve
watchdog status
"$PYSPY" dump --pid "$PID" --frobnicate
"$WATCHDOG" check \\
    --seconds soon
```

```sh kubectl
kubectl exec -n "$NS" "$POD" -c sidecar -- watchdog pause --for never
```

```
cp -a STATE_DIR/incidents/ID ~/
```

Then `"$WATCHDOG" resume --now` and `watchdog show ID --upstream`.
"""


KUBECTL_LINE = 'kubectl exec -n "$NS" "$POD" -c sidecar -- watchdog pause --for never'


def test_the_shell_check_passes_a_good_page_and_names_every_fault_of_a_bad_one(tmp_path: Path) -> None:
    (tmp_path / "good.md").write_text(GOOD_PAGE, encoding="utf-8")
    (tmp_path / "bad.md").write_text(BAD_PAGE, encoding="utf-8")
    check = shell_problems(_pages(tmp_path), {"engine-watchdog", "vllm-leader"})
    assert [p for p in check.problems if p.startswith("good.md")] == []
    assert check.parsed == {"watchdog": 5 + 6, "py-spy": 1 + 1, "kubectl": 2 + 1}  # good.md + bad.md
    bad = [p for p in check.problems if p.startswith("bad.md")]
    assert bad == [
        "bad.md:23: a fenced block is ```sh or ```sh kubectl, not ```",
        "bad.md: 0 ```sh kubectl blocks above the first section; one sets the variables, once",
        "bad.md:5: the top block sets variables; this line sets none: echo hello",
        "bad.md: WATCHDOG is watchdog, not the install's /opt/engine-watchdog/.venv/bin/watchdog",
        "bad.md: the top ```sh kubectl block sets NS and POD",
        "bad.md:11: $CFG is not set at the top of the page (```sh): \"$WATCHDOG\" show ID --config $CFG",
        "bad.md:11: placeholder ID (a variable set at the top, or a command that finds it): "
        "\"$WATCHDOG\" show ID --config $CFG",
        "bad.md:12: does not parse (watchdog: error: unrecognized arguments: --natve): \"$WATCHDOG\" dump --natve",
        "bad.md:13: watchdog is not on root's PATH: $WATCHDOG (set at the top): watchdog status",
        "bad.md:14: $PID is not set at the top of the page (```sh): \"$PYSPY\" dump --pid \"$PID\" --frobnicate",
        "bad.md:14: $PYSPY is not set at the top of the page (```sh): \"$PYSPY\" dump --pid \"$PID\" --frobnicate",
        "bad.md:14: py-spy dump has no option --frobnicate: \"$PYSPY\" dump --pid \"$PID\" --frobnicate",
        "bad.md:15: does not parse (watchdog check: error: argument --seconds: not a number of seconds: 'soon'): "
        "\"$WATCHDOG\" check --seconds soon",
        "bad.md:20: $NS is not set at the top of the page (```sh kubectl): " + KUBECTL_LINE,
        "bad.md:20: $POD is not set at the top of the page (```sh kubectl): " + KUBECTL_LINE,
        "bad.md:20: no container 'sidecar' in deploy/kubernetes (engine-watchdog, vllm-leader): " + KUBECTL_LINE,
        "bad.md:20: does not parse (watchdog pause: error: argument --for: not a duration: 'never' (e.g. 90s, 30m, "
        "2h, 1h30m)): " + KUBECTL_LINE,
        "bad.md:27: does not parse (watchdog: error: unrecognized arguments: --now): \"$WATCHDOG\" resume --now",
        "bad.md: `watchdog show ID --upstream`: placeholder ID",
    ]


def test_the_checks_catch_a_bad_command_a_bad_key_and_a_bad_link() -> None:
    assert watchdog_problem(["show", "20261201T100643Z", "--upstream"]) is None
    assert watchdog_problem(["--version"]) is None
    assert watchdog_problem(["frobnicate", "--now"]) == (
        "watchdog: error: argument command: invalid choice: 'frobnicate' (choose from 'check', 'run', 'record', "
        "'replay', 'dump', 'explain', 'incidents', 'show', 'report', 'pause', 'resume', 'reset', 'status', 'nodes', "
        "'init', 'config')")
    assert watchdog_problem(["show", "X", "--upstream", "--json"]) == (
        "watchdog show: error: argument --json: not allowed with argument --upstream")
    verbs = pyspy_verbs(PYSPY)
    assert {"dump", "top", "record"} <= set(verbs) and verbs["dump"].long["--pid"] and not verbs["dump"].positionals
    assert pyspy_problem(["record", "-p", "1", "-d", "20", "--format", "speedscope", "-o", "x.json"], verbs) is None
    assert pyspy_problem(["dump", "--pid"], verbs) == "py-spy dump --pid needs a value"
    assert pyspy_problem(["dump", "-x", "1"], verbs) == "py-spy dump has no option -x"
    assert pyspy_problem(["dump", "1"], verbs) == "py-spy dump takes no argument '1'"
    assert pyspy_problem(["flame"], verbs) == "no py-spy subcommand 'flame' (py-spy has dump, record, top)"
    assert {"engine-watchdog", "vllm-leader", "vllm-worker"} <= manifest_containers()
    keys = config_keys()
    assert {"judge", "restart", "restart.steps", "alerts", "alerts.sinks", "nodes", "gpu"} <= set(keys)
    refs = config_refs("`[judge] stall_window`, `restart.budgett`, `[[nodes]] liveness_stale`, gpu.jsonl, "
                       "`gpu.busy_util`, the engine. Then", set(keys))
    assert refs == [("judge", "stall_window"), ("nodes", "liveness_stale"), ("restart", "budgett"),
                    ("gpu", "busy_util")]
    assert "budgett" not in keys["restart"]
    assert broken_links("x.md", "[a](no-such-page.md) [b](frozen.md#no-such-heading) [c](https://example.com)") == [
        "no-such-page.md: no such file", "frozen.md#no-such-heading: no heading #no-such-heading in frozen.md"]
    assert slug("What to do `now`, in order") == "what-to-do-now-in-order"
