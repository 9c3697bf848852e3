"""``watchdog.scrape.page.read_page`` agrees with ``prometheus_client``'s full parser.

The reference below reads a page with ``prometheus_client.parser.text_string_to_metric_families`` and applies
read_page's documented rules to its samples: per ``engine`` label (absent: "0"), each gauge in ``GAUGES`` is the
sample's value, each counter in ``COUNTERS`` is the sum of its samples over the other labels, old spellings map
onto the current field, and a field with any non-finite part is dropped for that engine and listed in
``dropped``. Every real page we own (``tests/data/metrics``) and the shared corpus, when present, must read the
same both ways, as must synthetic pages built to hit the parser's corners.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from watchdog.core.types import EngineReading, PageReading
from watchdog.scrape.page import COUNTERS, DEFAULT_ENGINE, GAUGES, PageError, read_page

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "corpus" / "metrics"


def _real_pages() -> list[Path]:
    seen: set[str] = set()
    pages: list[Path] = []
    for folder in (DATA, SHARED):
        for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest not in seen:  # the shared corpus is copied into tests/data: test each page once
                seen.add(digest)
                pages.append(path)
    return pages


REAL_PAGES = _real_pages()


def test_the_repository_owns_real_pages() -> None:
    owned = sorted(p.name for p in DATA.glob("*.txt"))
    assert len(owned) >= 3, f"expected the corpus pages copied into {DATA}, found {owned}"


# -- the reference -------------------------------------------------------------------------------------


@dataclass
class Expected:
    engines: dict[str, EngineReading]
    vllm_series: int
    dropped_names: list[str] = field(default_factory=list)


def reference(text: str) -> Expected:
    """What read_page should return, computed from prometheus_client's parse."""
    wanted = {**{n: ("gauge", f) for n, f in GAUGES.items()}, **{n: ("counter", f) for n, f in COUNTERS.items()}}
    gauges: dict[str, dict[str, float]] = {}
    counters: dict[str, dict[str, float]] = {}
    models: dict[str, str] = {}
    poisoned: set[tuple[str, str]] = set()
    dropped: list[str] = []
    vllm_series = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                vllm_series += 1
            kind_field = wanted.get(sample.name)
            if kind_field is None:
                continue
            kind, field_ = kind_field
            engine = sample.labels.get("engine", DEFAULT_ENGINE)
            models.setdefault(engine, sample.labels.get("model_name", ""))
            value = float(sample.value)
            if not math.isfinite(value):
                poisoned.add((engine, field_))
                dropped.append(sample.name)
                continue
            if kind == "gauge":
                gauges.setdefault(engine, {})[field_] = value
            else:
                per_engine = counters.setdefault(engine, {})
                per_engine[field_] = per_engine.get(field_, 0.0) + value
    for engine, field_ in poisoned:
        gauges.get(engine, {}).pop(field_, None)
        counters.get(engine, {}).pop(field_, None)
    engines = {
        engine: EngineReading(
            engine=engine,
            model=models.get(engine, ""),
            running=gauges.get(engine, {}).get("running"),
            waiting=gauges.get(engine, {}).get("waiting"),
            kv_usage=gauges.get(engine, {}).get("kv_usage"),
            counters=counters.get(engine, {}),
        )
        for engine in set(gauges) | set(counters) | set(models)
    }
    return Expected(engines, vllm_series, dropped)


def assert_agrees(text: str) -> PageReading:
    got = read_page(text)
    # read again: the page must read the same (nothing of one read changes the next)
    assert read_page(text) == got, "the page read differently the second time"
    want = reference(text)
    assert set(got.engines) == set(want.engines), "read_page found other engines than prometheus_client"
    for engine, expected in want.engines.items():
        assert got.engines[engine] == expected, f"engine {engine!r} read differently"
    # counted only when the page has none of the wanted series (the only time the judge reads it)
    assert got.vllm_series == (0 if want.engines else want.vllm_series)
    assert sorted(d.split("{", 1)[0] for d in got.dropped) == sorted(want.dropped_names)
    return got


# -- real pages ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", REAL_PAGES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_real_page_agrees_with_prometheus_client(path: Path) -> None:
    got = assert_agrees(path.read_text(encoding="utf-8"))
    # Not vacuous: every engine on a real page after load has its gauges and progress counters.
    assert got.engines, "a real vLLM page must yield at least one engine"
    for reading in got.engines.values():
        assert reading.running is not None and reading.waiting is not None and reading.kv_usage is not None
        assert reading.model, "vLLM labels every engine series with model_name"
        assert {"generation_tokens", "prompt_tokens", "request_success", "iterations"} <= set(reading.counters)
    assert got.dropped == ()


def test_data_parallel_page_has_two_engines() -> None:
    page = read_page((DATA / "vllm-0.32.0-dp2-tp1-after-load.txt").read_text(encoding="utf-8"))
    assert sorted(page.engines) == ["0", "1"]
    # request_success is split by finished_reason: the reading is the sum over reasons (83 "length" + zeros).
    assert page.engines["0"].counters["request_success"] == 83.0
    assert page.engines["1"].counters["request_success"] == 63.0


def test_spec_decode_counters_are_read() -> None:
    page = read_page((DATA / "vllm-0.32.0-tp2-ngram-spec-after-load.txt").read_text(encoding="utf-8"))
    counters = page.engines["0"].counters
    assert (counters["spec_drafts"], counters["spec_draft_tokens"], counters["spec_accepted_tokens"]) == (43, 125, 1)


_SAMPLE = re.compile(r"^(vllm:[A-Za-z0-9_:]+)\{([^}]*)\} (\S+)$")
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"')


def _rewrite(text: str, rng: random.Random) -> str:
    """The same page with label order shuffled, values re-spelled, spacing varied and timestamps added."""
    out: list[str] = []
    for line in text.split("\n"):
        m = _SAMPLE.match(line)
        if m is None:
            out.append(line)
            continue
        name, labels, value = m.groups()
        pairs = _PAIR.findall(labels)
        rng.shuffle(pairs)
        label_text = ",".join(f'{k}="{v}"' for k, v in pairs) + rng.choice(["", ","])
        number = float(value)
        spelled = rng.choice([value, f"{number:e}", f"{number:E}", repr(number), f"{number:.17g}"])
        stamp = rng.choice(["", f" {rng.randrange(1_600_000_000_000, 1_900_000_000_000)}"])
        out.append(f"{name}{{{label_text}}} {spelled}{stamp}")
    return "\n".join(out)


@pytest.mark.parametrize("path", REAL_PAGES, ids=lambda p: f"{p.parent.name}/{p.name}")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rewritten_real_page_agrees(path: Path, seed: int) -> None:
    original = path.read_text(encoding="utf-8")
    rewritten = _rewrite(original, random.Random(seed))
    assert rewritten != original
    got = assert_agrees(rewritten)
    assert got.engines.keys() == read_page(original).engines.keys()


# -- synthetic pages -----------------------------------------------------------------------------------


def page(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def test_escaped_quotes_commas_and_braces_in_label_values() -> None:
    text = page(
        "# TYPE vllm:num_requests_running gauge",
        r'vllm:num_requests_running{engine="0",model_name="a \"quoted\", {braced} name"} 2',
        r'vllm:num_requests_waiting{model_name="a \"quoted\", {braced} name",engine="0"} 1',
        r'vllm:num_requests_running{engine="e,1}",model_name="back\\slash\nnewline"} 3',
        r'vllm:generation_tokens_total{engine="e,1}",model_name="back\\slash\nnewline",x="}{\"\""} 7',
    )
    got = assert_agrees(text)
    assert got.engines["0"].model == 'a "quoted", {braced} name'
    assert (got.engines["0"].running, got.engines["0"].waiting) == (2, 1)
    assert got.engines["e,1}"].model == "back\\slash\nnewline"
    assert got.engines["e,1}"].counters == {"generation_tokens": 7}


def test_unknown_escape_is_kept_as_written() -> None:
    # Only \\, \" and \n are escapes in the text format; prometheus_client leaves any other backslash alone.
    got = assert_agrees(page(r'vllm:num_requests_running{engine="0",model_name="C:\temp\x"} 1'))
    assert got.engines["0"].model == r"C:\temp\x"


@pytest.mark.parametrize("separator", ["\u2028", "\x85", "\x0c", "\r"])
def test_only_newline_ends_a_line(separator: str) -> None:
    # Label values may hold any Unicode; a line ends at "\n" only (str.splitlines would split at these too).
    got = assert_agrees(page(f'vllm:num_requests_running{{engine="0",model_name="a{separator}b"}} 1'))
    assert got.engines["0"].model == f"a{separator}b"


def test_labels_in_any_order_sum_per_engine() -> None:
    text = page(
        'vllm:request_success_total{engine="1",finished_reason="stop",model_name="m"} 5',
        'vllm:request_success_total{model_name="m",finished_reason="length",engine="1"} 6',
        'vllm:request_success_total{finished_reason="abort",engine="2",model_name="m"} 1',
        'vllm:request_success_total{ engine = "2" , finished_reason = "stop" , model_name="m" } 2',
        'vllm:num_requests_running{model_name="m",engine="1"} 0',
    )
    got = assert_agrees(text)
    assert got.engines["1"].counters == {"request_success": 11}
    assert got.engines["2"].counters == {"request_success": 3}
    assert got.engines["1"].running == 0 and got.engines["2"].running is None


def test_same_series_with_labels_reordered_is_a_duplicate() -> None:
    text = page(
        'vllm:generation_tokens_total{engine="0",model_name="m"} 5',
        'vllm:generation_tokens_total{model_name="m",engine="0"} 5',
    )
    with pytest.raises(PageError) as err:
        read_page(text)
    assert err.value.kind == "duplicate"
    assert "line 2" in err.value.message and "vllm:generation_tokens_total" in err.value.message


def test_no_engine_label_is_engine_zero() -> None:
    text = page(
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="old"} 1',
        "vllm:num_requests_waiting 4",
        'vllm:generation_tokens_total{model_name="old"} 10',
        "vllm:prompt_tokens_total 20",
    )
    got = assert_agrees(text)
    assert list(got.engines) == [DEFAULT_ENGINE] == ["0"]
    assert got.engines["0"] == EngineReading("0", "old", 1, 4, None, {"generation_tokens": 10, "prompt_tokens": 20})


def test_timestamps_after_values() -> None:
    text = page(
        'vllm:num_requests_running{engine="0"} 3 1700000000000',
        "vllm:num_requests_waiting 2 -1700000000000",
        'vllm:generation_tokens_total{engine="0"} 1e2 1700000000123',
    )
    got = assert_agrees(text)
    assert (got.engines["0"].running, got.engines["0"].waiting) == (3, 2)
    assert got.engines["0"].counters == {"generation_tokens": 100}


def test_exponent_notation() -> None:
    text = page(
        'vllm:kv_cache_usage_perc{engine="0"} 2.5E-4',
        'vllm:generation_tokens_total{engine="0",x="a"} 1.5e+03',
        'vllm:generation_tokens_total{engine="0",x="b"} 1e3',
        'vllm:prompt_tokens_total{engine="0"} 7.0000000000000000e+00',
        'vllm:estimated_flops_per_gpu_total{engine="0"} 1.7976931348623157e+308',
    )
    got = assert_agrees(text)
    assert got.engines["0"].kv_usage == 0.00025
    assert got.engines["0"].counters == {"generation_tokens": 2500, "prompt_tokens": 7,
                                         "estimated_flops": 1.7976931348623157e308}


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf", "Inf", "nan"])
def test_non_finite_value_drops_the_whole_series_for_that_engine(bad: str) -> None:
    text = page(
        'vllm:num_requests_running{engine="0"} 1',
        f'vllm:num_requests_waiting{{engine="0"}} {bad}',
        'vllm:num_requests_waiting{engine="1"} 2',
        'vllm:request_success_total{engine="0",finished_reason="stop"} 5',
        f'vllm:request_success_total{{engine="0",finished_reason="length"}} {bad}',
        'vllm:request_success_total{engine="1",finished_reason="stop"} 5',
        'vllm:request_success_total{engine="1",finished_reason="length"} 6',
        'vllm:generation_tokens_total{engine="0"} 9',
    )
    got = assert_agrees(text)
    zero, one = got.engines["0"], got.engines["1"]
    assert zero.waiting is None and zero.running == 1
    assert zero.counters == {"generation_tokens": 9}, "the finite part of a poisoned counter must not be kept"
    assert one.waiting == 2 and one.counters == {"request_success": 11}
    assert len(got.dropped) == 2
    assert any(d.startswith("vllm:num_requests_waiting{") for d in got.dropped)
    assert any(d.startswith("vllm:request_success_total{") and 'finished_reason="length"' in d for d in got.dropped)


def test_old_spellings_map_onto_current_fields() -> None:
    text = page(
        'vllm:num_requests_running{engine="0",model_name="m"} 1',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 40',
    )
    got = assert_agrees(text)
    assert got.engines["0"].kv_usage == 0.25
    assert got.engines["0"].counters == {"prefix_cache_queries": 40}


def test_every_wanted_name_is_read() -> None:
    lines = [f'{name}{{engine="3"}} {i + 1}' for i, name in enumerate(list(GAUGES) + list(COUNTERS))
             if name not in ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total")]
    got = assert_agrees(page(*lines))
    assert set(got.engines["3"].counters) == set(COUNTERS.values())


def test_unwanted_vllm_series_are_counted_but_not_read() -> None:
    text = page(
        'vllm:num_requests_running_extra{engine="0"} 1',
        'vllm:generation_tokens_created{engine="0"} 1.7e9',
        'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 5',
        'python_info{version="3.11"} 1',
        'xvllm:num_requests_running{engine="0"} 1',
    )
    got = assert_agrees(text)
    assert got.engines == {}
    assert got.vllm_series == 3


def test_empty_page_reads_as_no_engines() -> None:
    got = assert_agrees("")
    assert got == PageReading(engines={}, vllm_series=0)


def test_a_line_read_again_with_new_values_and_new_forms_reads_right() -> None:
    """One line from one scrape to the next: the values, a timestamp added later, a tab instead of a space or a value
    that stops being a number must still read as prometheus_client reads them."""
    head = 'vllm:generation_tokens_total{engine="0",model_name="a b"}'
    for rest in (" 1", " 2", " 3.5e2", " 4 1700000000000", "\t5", "  6", " 7"):
        got = assert_agrees(page(f"{head}{rest}", 'vllm:num_requests_running{engine="0"} 1'))
        assert got.engines["0"].counters["generation_tokens"] == float(rest.split()[0])
    with pytest.raises(PageError, match="not a number"):
        read_page(page(f"{head} 1_0"))
    with pytest.raises(PageError, match="not a number"):
        read_page(page(f"{head} x"))


_ODD_VALUES = ["0", "-0.0", "1e-05", "2.5E+3", "123456789012345678", "NaN", "+Inf", "-Inf", "1_0", "x", "",
               "3 1700000000000", "\t4", "0x10", "\u0661\u0662"]


@pytest.mark.parametrize("path", [DATA / "vllm-0.32.0-tp2-under-load.txt", DATA / "vllm-0.32.0-dp2-tp1-after-load.txt"],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("odd", _ODD_VALUES)
def test_a_real_page_with_new_values_and_one_odd_reads_as_prometheus_client(path: Path, odd: str) -> None:
    """A real page after the original, every wanted value re-spelled and one of them odd (not finite, not a number,
    followed by a timestamp, ...): read as prometheus_client reads it, or refused where prometheus_client refuses
    it too (as malformed, naming the line)."""
    original = path.read_text(encoding="utf-8")
    rng = random.Random(odd)
    lines = original.split("\n")
    wanted = [i for i, line in enumerate(lines)
              if (m := _SAMPLE.match(line)) is not None and (m.group(1) in GAUGES or m.group(1) in COUNTERS)]
    assert len(wanted) >= 10
    for i in wanted:
        value = rng.choice([f"{rng.uniform(0, 1e6):.6g}", f"{rng.randrange(10**9)}.0", f"{rng.random():e}"])
        lines[i] = lines[i][: lines[i].rindex(" ") + 1] + value
    assert_agrees(original)
    assert_agrees("\n".join(lines))
    at = rng.choice(wanted)
    lines[at] = lines[at][: lines[at].rindex(" ") + 1] + odd
    changed = "\n".join(lines)
    try:
        reference(changed)
    except ValueError:
        with pytest.raises(PageError) as err:
            read_page(changed)
        assert err.value.kind == "malformed" and err.value.message.startswith(f"line {at + 1}:")
    else:
        assert_agrees(changed)
