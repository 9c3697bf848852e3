"""The runbook pages (``runbooks/<name>.md``) held to the code they describe.

One page per `Runbook` value and no page without one; each page has the same four sections; every ``watchdog VERB
--flag`` a page names is a real subcommand and flag of the CLI's own parser; every config key a page names
(``[section] key`` or ``section.key``) is a field of the config dataclasses; every relative link resolves (a
``#anchor`` to a heading of the page it points at); the index (``runbooks/README.md``) links every page.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from watchdog.cli.main import _parser
from watchdog.config.load import Config
from watchdog.core.runbooks import Runbook

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
INDEX = "README.md"
SECTIONS = ("What the watchdog saw", "Confirm by hand", "What to do now", "Keep for the upstream report")
MAX_LINES = 100  # read at 3 a.m.: short

# Code: `spans` and fenced blocks. A command: "watchdog VERB ...", at the start or after a space, a path or a shell
# separator, up to the end of the line or the next separator.
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"(?:^|(?<=[\s/;&|(]))watchdog[ \t]+([a-z][\w-]*)([^\n;&|)]*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$", re.MULTILINE)
_FILE_SUFFIXES = {"md", "json", "jsonl", "csv", "txt", "toml", "pickle", "log", "py", "service"}


def _pages() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(RUNBOOKS.glob("*.md"))}


def _code(text: str) -> list[str]:
    blocks = _FENCE.findall(text)
    rest = _FENCE.sub("", text)
    return [*blocks, *_SPAN.findall(rest)]


def commands(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """Every ``watchdog VERB [args]`` in the text's code: (verb, the --flags it uses)."""
    out = []
    for code in _code(text):
        for m in _COMMAND.finditer(code):
            out.append((m.group(1), tuple(_FLAG.findall(m.group(2)))))
    return out


def cli_verbs() -> dict[str, set[str]]:
    """The CLI as its own parser builds it: each subcommand with its option strings."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {verb: {s for a in sp._actions for s in a.option_strings} for verb, sp in sub.choices.items()}


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


def test_every_command_a_page_names_is_a_real_subcommand_with_real_flags() -> None:
    verbs = cli_verbs()
    bad, seen = [], 0
    for name, text in _pages().items():
        for verb, flags in commands(text):
            seen += 1
            if verb not in verbs:
                bad.append(f"{name}: `watchdog {verb}`: no such subcommand")
                continue
            bad += [f"{name}: `watchdog {verb} {flag}`: no such flag" for flag in flags
                    if flag not in verbs[verb]]
    assert bad == []
    assert seen >= 2 * len(Runbook), "the pages name the commands to run (this check found too few to mean much)"


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


def test_the_checks_catch_a_bad_command_a_bad_key_and_a_bad_link() -> None:
    verbs = cli_verbs()
    assert {"check", "dump", "show", "status", "reset", "pause", "nodes"} <= set(verbs)
    assert "--url" in verbs["check"] and "--native" in verbs["dump"]
    said = commands("run `watchdog frobnicate --now`, then\n```\nsudo /opt/x/bin/watchdog dump --native --url U\n```\n"
                    "but not `engine-watchdog status` nor `watchdog_engine_state`")
    assert said == [("dump", ("--native", "--url")), ("frobnicate", ("--now",))]
    assert "frobnicate" not in verbs
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
