"""Reading the runbooks' shell as bash would, without running any of it.

A page's fenced blocks are ```sh (run in a root shell on the host the install made) or ```sh kubectl (run where
`kubectl` reaches the cluster). Each block is cut into logical lines (a trailing backslash joins the next one); each
line into its pieces (the line itself and every ``$(...)`` in it, nested ones too), each piece into simple commands
(argv lists, split at ``; | || && & ( )``, redirections dropped). What a line reads (``$NAME``, ``${NAME...}``
outside single quotes), what it sets (``NAME=``, ``for NAME in``, ``read NAME``, ``name() {``) and the placeholder
words it still holds (``ID``, ``URL``, ``STATE_DIR``: upper-case words no ``$`` expands) come from these.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

HOST, KUBECTL = "host", "kubectl"
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_NAME = re.compile(r"[A-Za-z_]\w*")
_ASSIGN = re.compile(r"([A-Za-z_]\w*)\+?=")
_FUNCTION = re.compile(r"^\s*([A-Za-z_][\w-]*)\s*\(\)\s*\{")
# an upper-case word of two or more characters that no `$` expands and that is not being assigned to
_PLACEHOLDER = re.compile(r"(?<![\w${-])[A-Z][A-Z0-9_]+(?![\w=])")
# upper-case words that are really typed: vLLM's process titles (VLLM::EngineCore), nvidia-smi's -d names
LITERAL_CAPS = frozenset({"VLLM", "ECC", "RETIRED_PAGES"})
_SEPARATORS = {";", "|", "||", "&&", "&", "(", ")", "()", ";;", "|&"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "<&", ">|", "&>>", "<<<"}
_KEYWORDS = {"{", "}", "do", "done", "then", "else", "fi", "if", "while", "until", "!", "time", "export", "local"}
SUBST = "__subst__"  # what a `$(...)` leaves in the line around it


@dataclass(frozen=True)
class Line:
    page: str
    number: int  # in the page, 1-based: where the logical line starts
    text: str
    kind: str  # HOST or KUBECTL
    top: bool  # in a block above the page's first section
    block: int  # which fenced block of the page, 0-based


@dataclass
class Reading:
    """What one logical line does, for the checks."""

    uses: set[str] = field(default_factory=set)
    sets: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    commands: list[list[str]] = field(default_factory=list)
    placeholders: list[str] = field(default_factory=list)
    assignments: dict[str, str] = field(default_factory=dict)  # NAME=value as written (unexpanded)


def blocks(page: str, text: str) -> tuple[list[Line], list[str]]:
    """Every logical line of every fenced block, and the blocks whose info string is neither sh nor sh kubectl."""
    first_section = text.find("\n## ")
    lines: list[Line] = []
    bad: list[str] = []
    for n, m in enumerate(_FENCE.finditer(text)):
        info = m.group(1).split()
        start = text.count("\n", 0, m.start(2)) + 1
        if info not in (["sh"], ["sh", KUBECTL]):
            bad.append(f"{page}:{start - 1}: a fenced block is ```sh or ```sh kubectl, not ```{m.group(1)}")
            continue
        kind = KUBECTL if info == ["sh", KUBECTL] else HOST
        top = first_section < 0 or m.start() < first_section
        pending, first = "", 0
        for i, raw in enumerate(m.group(2).splitlines()):
            if not pending:
                first = start + i
            if raw.endswith("\\"):
                pending += raw[:-1].strip() + " "
                continue
            whole = (pending + raw.strip()).strip()
            pending = ""
            if whole and not whole.startswith("#"):
                lines.append(Line(page, first, whole, kind, top, n))
    return lines, bad


def quoting(s: str) -> list[tuple[int, str, str]]:
    """Each character of ``s`` as bash reads it: (index, character, the quote it is inside: ``'``, ``"`` or "").
    A backslash outside single quotes takes the next character with it (neither is listed); the quote characters
    themselves are listed inside the quote they open or close."""
    out: list[tuple[int, str, str]] = []
    i, quote = 0, ""
    while i < len(s):
        c = s[i]
        if c == "\\" and quote != "'":
            i += 2
            continue
        if c in "'\"" and quote in ("", c):
            quote = "" if quote else c
            out.append((i, c, c))
        else:
            out.append((i, c, quote))
        i += 1
    return out


def _single_quoted(s: str) -> set[int]:
    """The indexes inside '...' (where ``$`` expands nothing)."""
    return {i for i, _c, quote in quoting(s) if quote == "'"}


def strip_comment(line: str) -> str:
    for i, c, quote in quoting(line):
        if c == "#" and not quote and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def _close(s: str, i: int) -> int:
    """The index of the ``)`` that ends the ``$(`` whose body starts at ``i``."""
    depth = 1
    for j, c, quote in quoting(s[i:]):
        depth += (c == "(" and not quote) - (c == ")" and not quote)
        if depth == 0:
            return i + j
    raise ValueError(f"unclosed $( in {s!r}")


def pieces(line: str) -> list[str]:
    """The line with each ``$(...)`` replaced by a word, then each ``$(...)``'s body, nested ones in turn."""
    single = _single_quoted(line)
    out, bodies, i = [], [], 0
    while (at := line.find("$(", i)) >= 0:
        if at in single or (at > 0 and line[at - 1] == "\\"):
            out.append(line[i:at + 2])
            i = at + 2
            continue
        end = _close(line, at + 2)
        out += [line[i:at], SUBST]
        bodies.append(line[at + 2:end])
        i = end + 1
    out.append(line[i:])
    return ["".join(out), *(p for body in bodies for p in pieces(body))]


def expansions(piece: str) -> set[str]:
    """The variables a piece (no ``$(`` left in it) expands: ``$NAME`` and ``${NAME...}`` outside single quotes."""
    single = _single_quoted(piece)
    names = set()
    for i, c, _quote in quoting(piece):
        if c == "$" and i not in single:
            m = _NAME.match(piece, i + 2 if piece.startswith("${", i) else i + 1)
            if m:
                names.add(m.group(0))
    return names


def simple_commands(piece: str) -> list[list[str]]:
    lexer = shlex.shlex(piece, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    tokens = list(lexer)
    skip = False
    for n, tok in enumerate(tokens):
        if skip:
            skip = False
        elif tok == "()":  # `name() {`: the word before it names a function, it runs nothing
            commands[-1] = []
        elif tok in _SEPARATORS:
            commands.append([])
        elif tok in _REDIRECTS:
            skip = True  # its target
            if commands[-1] and commands[-1][-1].isdigit():  # the fd number before `>&`
                commands[-1].pop()
        elif n + 1 < len(tokens) and tokens[n + 1] in _REDIRECTS and tok.isdigit():
            continue
        else:
            commands[-1].append(tok)
    return [c for c in commands if c]


def read_line(text: str) -> Reading:
    r = Reading()
    code = strip_comment(text)
    if m := _FUNCTION.match(code):
        r.functions.add(m.group(1))
    for piece in pieces(code):
        r.uses |= expansions(piece)
        bare = re.sub(r"\$\{?[A-Za-z_]\w*", "", piece)
        r.placeholders += [w for w in _PLACEHOLDER.findall(bare) if w not in LITERAL_CAPS]
        for words in simple_commands(piece):
            skip = 0  # leading keywords and NAME=value words: the command is what follows them
            while skip < len(words) and (words[skip] in _KEYWORDS or _ASSIGN.match(words[skip])):
                if m := _ASSIGN.match(words[skip]):
                    r.sets.add(m.group(1))
                    r.assignments[m.group(1)] = words[skip][m.end():]
                skip += 1
            argv = words[skip:]
            if argv and argv[0] == "for" and len(argv) > 1:
                r.sets.add(argv[1])
                continue
            if argv and argv[0] == "read":
                r.sets |= {a for a in argv[1:] if _NAME.fullmatch(a)}
            if argv:
                r.commands.append(argv)
    return r


# -- py-spy's own options, from its --help ---------------------------------------------------------------------

_OPTION = re.compile(r"^[ \t]+(?:-(\w), )?(--[\w-]+)(?:\.\.\.)?(?: <[^>]+>)?", re.MULTILINE)


@dataclass(frozen=True)
class SpyVerb:
    short: dict[str, bool]  # letter -> takes a value
    long: dict[str, bool]
    positionals: bool  # `Usage: py-spy record [OPTIONS] [python_program]...`


def _help(pyspy: Path, *verb: str) -> str:
    done = subprocess.run([str(pyspy), *verb, "--help"], capture_output=True, text=True, timeout=30, check=True)
    return done.stdout


@cache
def pyspy_verbs(pyspy: Path) -> dict[str, SpyVerb]:
    """Each py-spy subcommand with the options its --help lists."""
    top = _help(pyspy)
    listed = top.split("Commands:", 1)[1].split("\n\n", 1)[0]
    verbs = [m.group(1) for m in re.finditer(r"^[ \t]+([a-z][\w-]*)[ \t]", listed, re.MULTILINE)
             if m.group(1) != "help"]
    out = {}
    for verb in verbs:
        text = _help(pyspy, verb)
        short, long = {}, {}
        for m in _OPTION.finditer(text):
            takes = "<" in m.group(0)
            long[m.group(2)] = takes
            if m.group(1):
                short[m.group(1)] = takes
        usage = next(line for line in text.splitlines() if line.startswith("Usage:"))
        out[verb] = SpyVerb(short, long, usage.strip() != f"Usage: py-spy {verb} [OPTIONS]")
    return out


def pyspy_problem(argv: list[str], verbs: dict[str, SpyVerb]) -> str | None:
    """Why py-spy would refuse these arguments (after `py-spy`), or None."""
    if not argv or argv[0] not in verbs:
        return f"no py-spy subcommand {argv[0] if argv else ''!r} (py-spy has {', '.join(sorted(verbs))})"
    verb, rest = verbs[argv[0]], argv[1:]
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("--"):
            name, eq, _ = tok.partition("=")
            if name not in verb.long:
                return f"py-spy {argv[0]} has no option {name}"
            if verb.long[name] and not eq:
                i += 1
                if i >= len(rest):
                    return f"py-spy {argv[0]} {name} needs a value"
        elif tok.startswith("-") and len(tok) > 1:
            for n, letter in enumerate(tok[1:]):
                if letter not in verb.short:
                    return f"py-spy {argv[0]} has no option -{letter}"
                if verb.short[letter]:
                    if n != len(tok) - 2:
                        break  # the value is the rest of the word
                    i += 1
                    if i >= len(rest):
                        return f"py-spy {argv[0]} -{letter} needs a value"
        elif not verb.positionals:
            return f"py-spy {argv[0]} takes no argument {tok!r}"
        i += 1
    return None
