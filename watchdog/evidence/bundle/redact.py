"""What text from a bundle may say outside this site (the upstream bug report). Pure: strings in, strings out.

The rules, applied to every piece of free text taken from a bundle or the event log (reasons, problems, GPU lines):

- addresses: every IPv4 and IPv6 literal, the host part (and any user:password) of every URL, and each host name
  the caller names (the engine URL's host, each ``[[nodes]]`` host, this machine's name) become ``<host>``, unless
  the caller keeps addresses. ``[[nodes]]`` names (the operator's labels: ``worker1``) are kept;
- file paths: inside ``site-packages``/``dist-packages`` the path from the package on (``vllm/v1/engine/core.py``),
  inside a Python's ``lib/pythonX.Y`` the stdlib path (``threading.py``), anything else its last part only
  (``/home/alice/run/serve.py`` -> ``serve.py``): no home directory, user or checkout name survives;
- secrets: ``NAME=value`` in capitals (an environment variable) keeps its name only; ``token=...``,
  ``api_key: ...``, ``--api-key X``, ``Bearer X`` keep the key's name only; strings shaped like known tokens
  (``sk-``, ``hf_``, ``ghp_``, ``xoxb-``, AWS ``AKIA``, JWTs) and any run of 32+ letters and digits mixed become
  ``<secret>``.

Frames keep their function names (code, not data) and get the path rule alone. Prompt text, locals, environments and
log tails never reach a report in the first place (upstream.py takes none of them); these rules are the second line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

HOST = "<host>"
SECRET = "<secret>"  # noqa: S105 - the mark that replaces one

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\w)")
# at least "::" or three colons between hex groups: times (10:06:14) and C++ names (c10::cuda) are left alone
_IPV6 = re.compile(r"(?<![\w:.])(?=[0-9A-Fa-f:]*::|(?:[0-9A-Fa-f]{1,4}:){3})(?:[0-9A-Fa-f]{0,4}:){2,7}"
                   r"[0-9A-Fa-f]{0,4}(?![\w:])")
_URL = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)(?:[^/\s@]*@)?(\[[^\]\s]*\]|[^/\s:]+)")
_PATH = re.compile(r"(?<![\w.:>/~-])~?/[^\s()\[\]{}<>,;:'\"|*?`]+")
_PYLIB = re.compile(r"/lib/python\d+(?:\.\d+)?/(.+)$")
_ENV = re.compile(r"\b([A-Z][A-Z0-9_]{2,})=(\"[^\"]*\"|'[^']*'|\S+)")
_KEYWORD = r"[\w-]*(?:token|secret|passw(?:or)?d|api[_-]?key|apikey|credential|authorization)[\w-]*"
_KEYVALUE = re.compile(rf"(?i)\b({_KEYWORD})(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;]+)")
_FLAG = re.compile(rf"(?i)(--{_KEYWORD})(\s+|=)(\"[^\"]*\"|'[^']*'|[^\s,;]+)")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[\w.~+/=-]{8,}")
_TOKENS = re.compile(r"\b(?:sk-[\w-]{16,}|hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|xox[abposr]-[\w-]{10,}"
                     r"|AKIA[0-9A-Z]{16}|eyJ[\w-]{8,}\.[\w-]{8,}\.[\w-]+)")
_LONG = re.compile(r"(?<![\w/.-])(?=[\w+/=]*\d)(?=[\w+/=]*[A-Za-z])[\w+/=]{32,}(?![\w/.-])")


def short_path(path: str) -> str:
    """A file path without the directories that say whose machine it was (the rule in the module's doc)."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if m := _PYLIB.search(path):
        return m.group(1)
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last or path


def _hosts(text: str, hosts: Sequence[str]) -> str:
    for h in sorted({h for h in hosts if h and len(h) > 1}, key=len, reverse=True):
        text = re.sub(rf"(?i)(?<![\w.-]){re.escape(h)}(?![\w-]|\.\w)", HOST, text)
    return text


def scrub(text: str, hosts: Sequence[str] = (), keep_addresses: bool = False) -> str:
    """``text`` with secrets, paths and (unless kept) addresses and the named hosts taken out."""
    text = _BEARER.sub(lambda m: f"{m.group(1)} {SECRET}", text)
    text = _FLAG.sub(lambda m: f"{m.group(1)}{m.group(2)}{SECRET}", text)
    text = _KEYVALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}{SECRET}", text)
    text = _ENV.sub(lambda m: f"{m.group(1)}={SECRET}", text)
    text = _TOKENS.sub(SECRET, text)
    if not keep_addresses:
        text = _URL.sub(lambda m: f"{m.group(1)}{HOST}", text)
        text = _IPV4.sub(HOST, text)
        text = _IPV6.sub(HOST, text)
        text = _hosts(text, hosts)
    text = _PATH.sub(lambda m: short_path(m.group(0)), text)
    return _LONG.sub(SECRET, text)


def one_line(text: str, limit: int = 400) -> str:
    """Free text for a Markdown line or table cell: one line, no pipes, capped."""
    flat = " ".join(str(text).split()).replace("|", "/")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
