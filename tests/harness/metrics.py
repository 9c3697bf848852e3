"""Minimal reading of a Prometheus text page, for the harness's own checks (not the watchdog's parser)."""

from __future__ import annotations

from collections import defaultdict

# The series the harness looks at; each value is summed over label sets (one engine here).
WATCHED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:iteration_tokens_total_count",
)


def sample_sums(text: str, names: tuple[str, ...] | None = None) -> dict[str, float]:
    """Sum of the samples of each series name (labels ignored); only `names` if given."""
    sums: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if names is not None and name not in names:
            continue
        try:
            sums[name] += float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return dict(sums)


def watched(text: str) -> dict[str, float]:
    return sample_sums(text, WATCHED)
