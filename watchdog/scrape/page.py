"""Read the few series the judgement needs out of a Prometheus text page.

A TP=2 vLLM page is ~56 KB and ~90 metric families; the judgement needs about a dozen lines of it.
This reader skips every line that does not start with ``vllm:`` and looks only at the names it
wants, which is far cheaper than a full parse (see ``bench/``). ``tests/unit/test_page_conformance.py``
proves it agrees with ``prometheus_client``'s parser on real pages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TypeVar

from watchdog.core.types import EngineReading, PageReading

# Gauges the judgement reads, with the older spelling mapped onto the current one.
GAUGES: Mapping[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # renamed to kv_cache_usage_perc; gone by 0.14
}

# Counters whose advance means the engine did work. Summed over their other labels per engine.
# Older spellings map onto the current name so progress is compared like with like.
COUNTERS: Mapping[str, str] = {
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:request_success_total": "request_success",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:iteration_tokens_total_count": "iterations",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:spec_decode_num_drafts_total": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_accepted_tokens",
    "vllm:estimated_flops_per_gpu_total": "estimated_flops",
}

# Counters that only move when a request emits output: their advance proves the engine serves.

# Old spellings count only when the current one is absent (vLLM 0.9/0.10 exposed both at once).
LEGACY = frozenset({"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total"})
_LEGACY_PREFIX = "legacy:"

_WANTED: Mapping[str, tuple[str, str]] = {
    **{name: ("gauge", (_LEGACY_PREFIX if name in LEGACY else "") + f) for name, f in GAUGES.items()},
    **{name: ("counter", (_LEGACY_PREFIX if name in LEGACY else "") + f) for name, f in COUNTERS.items()},
}

# The sample names read, for a server that can answer with only these (prometheus_client's ``name[]`` filter).
WANTED_SAMPLES: tuple[str, ...] = tuple(sorted(_WANTED))

# A wanted series' line: its name after a newline, followed by labels or white space. Every wanted name starts
# with "vllm:", so the pattern starts with the literal "\nvllm:" and re skips to each occurrence at C speed (a
# `^` in MULTILINE mode is tried at every character: 8x slower on a 53 KB page, measured). The page is searched
# with a newline in front, so its first line counts too; group 1 is the name without the prefix, group 2 the rest
# of the line (labels, value, timestamp).
_PREFIX = "vllm:"
assert all(n.startswith(_PREFIX) for n in _WANTED)
_NAMES = "|".join(re.escape(n[len(_PREFIX):]) for n in sorted(_WANTED, key=len, reverse=True))
_WANTED_LINE = re.compile("\n" + _PREFIX + "(" + _NAMES + r")(?=[{ \t])([^\n]*)")

_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = re.compile(r'\\([\\n"])')  # the only escapes in the text format; any other backslash stays

DEFAULT_ENGINE = "0"  # vLLM before data parallelism had no `engine` label; a single engine is "0".
# More engines than any deployment runs (data-parallel ranks of one server): a page naming more is refused, not read
# (100,000 engine labels in 3.6 MB took seconds to read, and the page cap allows 16 MiB).
MAX_ENGINES = 256
# More wanted samples than any such deployment shows (15 wanted names, a few label variants each: a real engine shows
# a dozen or two): one engine with an extra label per line would otherwise pass the engine cap with 100,000 lines.
MAX_SAMPLES = MAX_ENGINES * 64


class PageError(Exception):
    """The page cannot be read as a vLLM metrics page. ``kind`` is a short stable code."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            if text[pos:].strip() == "":
                break
            raise PageError("malformed", f"cannot read labels {{{text}}}")
        labels[m.group(1)] = _UNESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), m.group(2))
        pos = m.end()
    return labels


class _Series:
    """What one series' head (name and label text) means."""

    __slots__ = ("engine", "field", "gauge", "key", "model")

    def __init__(self, name: str, label_text: str) -> None:
        labels = _parse_labels(label_text) if label_text else {}
        kind, self.field = _WANTED[name]
        self.gauge = kind == "gauge"
        self.key = (name, tuple(sorted(labels.items())))  # two heads naming one series are a duplicate
        self.engine = labels.get("engine", DEFAULT_ENGINE)
        self.model = labels.get("model_name", "")


def _value(text: str, line: str) -> float:
    """The sample's value: the first field after the name and labels (a timestamp may follow)."""
    parts = text.split(None, 1)
    if not parts:
        raise PageError("malformed", f"sample has no value: {line[:120]!r}")
    try:
        if "_" in parts[0]:
            raise ValueError(parts[0])  # Python's float() takes 1_0; the exposition format does not
        return float(parts[0])
    except ValueError:
        raise PageError("malformed", f"value {parts[0][:40]!r} is not a number") from None


def _parse_line(padded: str, m: re.Match[str]) -> tuple[_Series, str, float]:
    """A wanted line read in full: its series, its label text and its value (an optional timestamp ignored)."""
    short, rest = m.group(1, 2)
    try:
        if rest[:1] == "{":
            close = rest.rfind("}")
            if close < 0:
                raise PageError("malformed", f"unclosed label set: {_PREFIX + short + rest[:120]!r}")
            label_text, after = rest[1:close], rest[close + 1 :]
        else:
            label_text, after = "", rest
        value = _value(after, rest)
        series = _Series(_PREFIX + short, label_text)
    except PageError as e:
        raise PageError(e.kind, f"line {padded.count(chr(10), 0, m.start() + 1)}: {e.message}") from None
    return series, label_text, value


_T = TypeVar("_T")


def _current_spelling(per_engine: dict[str, _T]) -> None:
    """An old spelling's reading moves to the current field, unless the current spelling was read too."""
    for legacy in [k for k in per_engine if k.startswith(_LEGACY_PREFIX)]:
        per_engine.setdefault(legacy[len(_LEGACY_PREFIX) :], per_engine.pop(legacy))


def _engines(samples: list[tuple[_Series, float]], poisoned: set[tuple[str, str]]) -> dict[str, EngineReading]:
    """Each engine's reading from its samples: a gauge's value, a counter's values summed in page order. A field
    with a non-finite part (``poisoned``) is left out."""
    gauges: dict[str, dict[str, float]] = {}
    counters: dict[str, dict[str, float]] = {}
    models: dict[str, str] = {}
    for s, value in samples:
        models.setdefault(s.engine, s.model)
        if (s.engine, s.field) in poisoned:
            continue
        if s.gauge:
            gauges.setdefault(s.engine, {})[s.field] = value
        else:
            per_engine = counters.setdefault(s.engine, {})
            per_engine[s.field] = per_engine[s.field] + value if s.field in per_engine else value
    engines: dict[str, EngineReading] = {}
    for engine in sorted(models):
        g, c = gauges.get(engine, {}), counters.get(engine, {})
        _current_spelling(g)
        _current_spelling(c)
        engines[engine] = EngineReading(engine, models[engine], g.get("running"), g.get("waiting"),
                                        g.get("kv_usage"), c)
    return engines


def read_page(text: str) -> PageReading:
    """Pick the judgement's series out of a page. Raises PageError when the page is not usable."""
    if text.lstrip()[:1] == "<":
        raise PageError("html", "the page is HTML, not Prometheus text: is the URL the vLLM server's base URL?")
    if text and not text.endswith("\n"):
        raise PageError("truncated", f"the page ends mid-line after {len(text)} characters (cut off)")
    padded = "\n" + text  # positions in `padded` are one past those in `text`
    samples: list[tuple[_Series, float]] = []
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    dropped: list[str] = []
    poisoned: set[tuple[str, str]] = set()  # (engine, field) with a non-finite part: unusable
    engine_labels: set[str] = set()
    # Only the wanted lines are visited: one C-level regex scan finds them; the rest of the page is skipped.
    for m in _WANTED_LINE.finditer(padded):
        series, label_text, value = _parse_line(padded, m)
        if series.key in seen:
            line_no = padded.count("\n", 0, m.start() + 1)
            raise PageError("duplicate", f"line {line_no}: series {series.key[0]}{{{label_text}}} appears twice")
        seen.add(series.key)
        if series.engine not in engine_labels:
            engine_labels.add(series.engine)
            if len(engine_labels) > MAX_ENGINES:
                raise PageError("malformed", f"the page names more than {MAX_ENGINES} engines: not a vLLM page")
        if len(samples) >= MAX_SAMPLES:
            raise PageError("malformed", f"the page has more than {MAX_SAMPLES} samples of the series read "
                                         f"(at most {MAX_ENGINES} engines x 64): not a vLLM page")
        samples.append((series, value))
        if not math.isfinite(value):
            dropped.append(f"{series.key[0]}{{{label_text}}} = {value}")
            poisoned.add((series.engine, series.field))
    engines = _engines(samples, poisoned)
    # counted only when it is read: a page with none of the wanted series says how many vllm: series it had
    vllm_series = 0 if engines else text.count("\nvllm:") + text.startswith("vllm:")
    return PageReading(engines=engines, vllm_series=vllm_series, dropped=tuple(dropped))
