"""The runbooks' shell held to what it runs: the CLI's own parser, py-spy's --help, the shipped manifests.

`ShellCheck` reads each page with tests/unit/runbook_shell.py and lists every problem with its page and line: the
top ```sh block (and ```sh kubectl block, where the page has kubectl lines) sets each variable once, before the
first section; no line uses a variable those blocks do not set, nor holds a placeholder word; `watchdog` and
`py-spy` on the host are the install's (``$WATCHDOG``, ``$PYSPY``), in a pod ``kubectl exec ... -- watchdog``;
each watchdog line parses with the CLI's parser, each py-spy line with py-spy's options, each container a kubectl
line names is a manifest's. It also counts what it parsed, so that a test can tell it read something.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from tests.unit.runbook_shell import HOST, KUBECTL, Line, blocks, expansions, pyspy_problem, pyspy_verbs, read_line
from watchdog.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
# where the README's install puts them (the shipped unit runs the first)
INSTALLED = {"WATCHDOG": "/opt/engine-watchdog/.venv/bin/watchdog", "PYSPY": "/opt/engine-watchdog/.venv/bin/py-spy"}
PYSPY = Path(sys.executable).parent / "py-spy"  # the test venv's, the same version scripts/setup installs
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`\n]+)`")


def watchdog_problem(argv: list[str]) -> str | None:
    """argparse's complaint about ``watchdog ARGV``, from the parser the command itself builds; None if it parses."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):  # 0: --version, --help
            return said.getvalue().strip().splitlines()[-1]
    return None


def manifest_containers(where: Path = MANIFESTS) -> set[str]:
    """Every container and init container of the shipped Kubernetes manifests."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    names.update(c["name"] for c in value if isinstance(c, dict) and "name" in c)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for path in sorted(where.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            walk(doc)
    return names


def spans(page: str, text: str) -> list[Line]:
    """The prose's `code` that is a command: it runs $WATCHDOG, $PYSPY or kubectl, or expands a variable."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    first_section = prose.find("\n## ")
    out = []
    for m in _SPAN.finditer(prose):
        try:
            head = shlex.split(m.group(1))[:1]
        except ValueError:
            continue
        if head in (["$WATCHDOG"], ["$PYSPY"], ["kubectl"]) or expansions(m.group(1)):
            out.append(Line(page, prose.count("\n", 0, m.start()) + 1, m.group(1),
                            KUBECTL if head == ["kubectl"] else HOST, first_section < 0 or m.start() < first_section,
                            -1))
    return out


def _references(text: str) -> list[str]:
    """Prose naming a verb (`watchdog reset`, the daemon's own words): not for pasting, but real all the same."""
    prose = FENCE.sub("", text)
    return [span for span in _SPAN.findall(prose) if re.match(r"watchdog [a-z]", span)]


def _expand(value: str, known: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: known.get(m.group(1), m.group(0)), value.strip('"'))


class ShellCheck:
    """Every problem of the pages' shell, each with its page and line; and how many commands it parsed."""

    def __init__(self, containers: set[str]) -> None:
        self.containers = containers
        self.verbs = pyspy_verbs(PYSPY)
        self.problems: list[str] = []
        self.parsed: Counter[str] = Counter()

    def page(self, page: str, text: str) -> None:
        lines, bad = blocks(page, text)
        self.problems += bad
        found_spans = spans(page, text)
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        self.problems += [f"{page}:{n}: a `span` crosses the line's end (the check reads spans one line at a time)"
                          for n, line in enumerate(prose.splitlines(), 1) if line.count("`") % 2]
        top = {kind: [ln for ln in lines if ln.top and ln.kind == kind] for kind in (HOST, KUBECTL)}
        for kind, want in ((HOST, 1), (KUBECTL, 1)):
            found = len({ln.block for ln in top[kind]})
            if found != want and (kind == HOST or any(ln.kind == kind for ln in lines + found_spans)):
                self.problems.append(f"{page}: {found} ```sh{' kubectl' if kind == KUBECTL else ''} blocks above "
                                     "the first section; one sets the variables, once")
        defined: dict[str, set[str]] = {HOST: set(), KUBECTL: set()}
        values: dict[str, str] = {}
        for ln in top[HOST] + top[KUBECTL]:
            r = read_line(ln.text)
            if not r.sets and not r.functions:
                self.problems.append(f"{page}:{ln.number}: the top block sets variables; this line sets none: "
                                     f"{ln.text}")
            self._uses(ln, r.uses - r.sets - defined[ln.kind], "before the top block sets it")
            defined[ln.kind] |= r.sets | r.functions
            for k, v in r.assignments.items() if ln.kind == HOST else ():
                values[k] = _expand(v, values)
        for name, path in INSTALLED.items():
            if name in values and values[name] != path:
                self.problems.append(f"{page}: {name} is {values[name]}, not the install's {path}")
        if any(ln.kind == KUBECTL for ln in lines + found_spans) and not {"NS", "POD"} <= defined[KUBECTL]:
            self.problems.append(f"{page}: the top ```sh kubectl block sets NS and POD")
        used: set[str] = set()
        for ln in lines + found_spans:
            r = read_line(ln.text)
            used |= r.uses | {argv[0] for argv in r.commands}
            if not ln.top:
                block = "```sh kubectl" if ln.kind == KUBECTL else "```sh"
                self._uses(ln, r.uses - r.sets - defined[ln.kind], f"at the top of the page ({block})")
            if r.placeholders:
                self.problems.append(f"{page}:{ln.number}: placeholder {', '.join(r.placeholders)} (a variable set "
                                     f"at the top, or a command that finds it): {ln.text}")
            for argv in r.commands:
                self._command(ln, argv, ln.kind)
        for kind in (HOST, KUBECTL):
            for name in sorted(defined[kind] - used):
                self.problems.append(f"{page}: {name} is set at the top and never used")
        for span in _references(text):
            self.parsed["watchdog"] += 1
            if (why := watchdog_problem(shlex.split(span)[1:])) is not None:
                self.problems.append(f"{page}: `{span}`: {why}")
            elif words := read_line(span).placeholders:
                self.problems.append(f"{page}: `{span}`: placeholder {', '.join(words)}")

    def _uses(self, ln: Line, missing: set[str], where: str) -> None:
        for name in sorted(missing):
            self.problems.append(f"{ln.page}:{ln.number}: ${name} is not set {where}: {ln.text}")

    def _command(self, ln: Line, argv: list[str], where: str) -> None:
        name = argv[0]
        at = f"{ln.page}:{ln.number}"
        if where == HOST and name in ("watchdog", "py-spy"):
            self.problems.append(f"{at}: {name} is not on root's PATH: ${'WATCHDOG' if name == 'watchdog' else 'PYSPY'}"
                                 f" (set at the top): {ln.text}")
        elif where == KUBECTL and name in ("watchdog", "py-spy", "$WATCHDOG", "$PYSPY"):
            self.problems.append(f"{at}: {name} runs in the pod: kubectl exec ... -- {name.lstrip('$').lower()}: "
                                 f"{ln.text}")
        elif name in ("$WATCHDOG", "watchdog", INSTALLED["WATCHDOG"]):
            self.parsed["watchdog"] += 1
            if (why := watchdog_problem(argv[1:])) is not None:
                self.problems.append(f"{at}: does not parse ({why}): {ln.text}")
        elif name in ("$PYSPY", "py-spy", INSTALLED["PYSPY"]):
            self.parsed["py-spy"] += 1
            if (why := pyspy_problem(argv[1:], self.verbs)) is not None:
                self.problems.append(f"{at}: {why}: {ln.text}")
        elif name == "kubectl":
            self.parsed["kubectl"] += 1
            for i, tok in enumerate(argv):
                named = argv[i + 1] if tok in ("-c", "--container") and i + 1 < len(argv) else \
                    tok.partition("=")[2] if tok.startswith("--container=") else None
                if named is not None and named not in self.containers:
                    self.problems.append(f"{at}: no container {named!r} in {MANIFESTS.relative_to(ROOT)} "
                                         f"({', '.join(sorted(self.containers))}): {ln.text}")
            if len(argv) > 1 and argv[1] == "exec" and "--" in argv and argv.index("--") + 1 < len(argv):
                self._command(ln, argv[argv.index("--") + 1:], "pod")


def shell_problems(pages: dict[str, str], containers: set[str] | None = None) -> ShellCheck:
    check = ShellCheck(manifest_containers() if containers is None else containers)
    for name, text in pages.items():
        check.page(name, text)
    return check
