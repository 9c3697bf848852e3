"""Bounded load for a real vLLM: a few threads posting completions until stopped or a deadline."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import requests

DEFAULT_PROMPT = "the quick brown fox jumps over the lazy dog"


def long_prompt(n_tokens: int, seed: int = 0) -> str:
    """A prompt of exactly `n_tokens` tokens for the harness models' tokenizer, BOS included.

    The tokenizer was trained on text without digits, so every digit is one token and digits never
    merge: n-1 digits plus the BOS token. The server's `usage.prompt_tokens` confirms the count.
    """
    if n_tokens < 2:
        raise ValueError("n_tokens must be at least 2 (BOS + one digit)")
    rng = random.Random(seed)
    return "".join(rng.choice("0123456789") for _ in range(n_tokens - 1))


def calibrated_tokens(url: str, model: str, seconds: float, most: int, probe: int = 1024) -> int:
    """How many prompt tokens this server prefills in about ``seconds`` (at most ``most``), measured here: machines
    differ about 5x (bf16 native or emulated), so a long step is sized by timing a prefill of ``probe`` tokens on the
    server at hand, never by a fixed length. Attention makes longer prompts slower per token, so the estimate errs
    long. Raises if even ``most`` tokens cannot last ``seconds``/2: the scenario cannot be built on this machine."""
    warm = post_completion(url, model, long_prompt(16, seed=7), max_tokens=1, timeout=120)
    if not warm.ok:
        raise RuntimeError(f"calibration: the warm-up request failed: {warm.error}")
    timed = post_completion(url, model, long_prompt(probe, seed=8), max_tokens=1, timeout=600)
    if not timed.ok:
        raise RuntimeError(f"calibration: the {probe}-token request failed: {timed.error}")
    rate = probe / max(timed.elapsed, 1e-3)
    wanted = int(seconds * rate)
    if wanted > most and most / rate < seconds / 2:
        raise RuntimeError(f"calibration: this machine prefills {rate:.0f} tokens/s; {most} tokens last about "
                           f"{most / rate:.1f}s, not the {seconds:g}s the scenario needs")
    return max(probe, min(wanted, most))


@dataclass
class Result:
    """Outcome of one completion request."""

    ok: bool
    status: int | None = None
    body: Any = None
    error: str | None = None
    elapsed: float = 0.0


def post_completion(
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float,
    session: requests.Session | None = None,
    **extra: Any,
) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}
    t0 = time.monotonic()
    try:
        r = (session or requests).post(f"{url}/v1/completions", json=body, timeout=timeout)
    except requests.RequestException as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}", elapsed=time.monotonic() - t0)
    elapsed = time.monotonic() - t0
    try:
        payload: Any = r.json()
    except ValueError:
        payload = r.text
    return Result(r.status_code == 200, r.status_code, payload, None if r.ok else r.text[:500], elapsed)


class BackgroundRequest:
    """One completion request running in a daemon thread; `result()` collects it later."""

    def __init__(
        self, url: str, model: str, prompt: str, max_tokens: int = 1, timeout: float = 300.0, **extra: Any
    ) -> None:
        self.started_at = time.monotonic()
        self._result: Result | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(url, model, prompt, max_tokens, timeout),
            kwargs=extra,
            name="background-completion",
            daemon=True,
        )
        self._thread.start()

    def _run(self, *args: Any, **kwargs: Any) -> None:
        self._result = post_completion(*args, **kwargs)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> Result:
        """The request's Result; raises TimeoutError if it has not finished within `timeout`."""
        self._thread.join(timeout)
        if self._thread.is_alive() or self._result is None:
            raise TimeoutError("completion request still running")
        return self._result


@dataclass
class LoadStats:
    successes: int = 0
    failures: int = 0
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)  # the last few, for messages


class LoadGenerator:
    """`threads` workers each posting /v1/completions in a loop (ignore_eos, random max_tokens).

    Stops on `stop()`, on leaving the `with` block, or at `duration` seconds after `start()`.
    Every request has `request_timeout`; a failed request is counted and followed by a short pause.
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        threads: int = 4,
        max_tokens: tuple[int, int] = (16, 64),
        prompt: str = DEFAULT_PROMPT,
        duration: float | None = 600.0,
        request_timeout: float = 60.0,
        seed: int = 0,
    ) -> None:
        self.url = url
        self.model = model
        self.threads = threads
        self.max_tokens = max_tokens
        self.prompt = prompt
        self.duration = duration
        self.request_timeout = request_timeout
        self.seed = seed
        self.stats = LoadStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def start(self) -> LoadGenerator:
        if self._workers:
            raise RuntimeError("already started")
        deadline = None if self.duration is None else time.monotonic() + self.duration
        for i in range(self.threads):
            t = threading.Thread(target=self._loop, args=(i, deadline), name=f"load-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def stop(self, timeout: float | None = None) -> LoadStats:
        """Stop and wait for the workers (at most `timeout`, default request_timeout + 5 s)."""
        self._stop.set()
        deadline = time.monotonic() + (self.request_timeout + 5 if timeout is None else timeout)
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.stats

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._workers)

    def _loop(self, index: int, deadline: float | None) -> None:
        rng = random.Random(self.seed * 1000 + index)
        with requests.Session() as session:
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                result = post_completion(
                    self.url,
                    self.model,
                    self.prompt,
                    rng.randint(*self.max_tokens),
                    self.request_timeout,
                    session=session,
                    ignore_eos=True,
                    temperature=1.0,
                )
                with self._lock:
                    if result.ok:
                        self.stats.successes += 1
                        usage = (result.body.get("usage") or {}) if isinstance(result.body, dict) else {}
                        self.stats.completion_tokens += int(usage.get("completion_tokens") or 0)
                    else:
                        self.stats.failures += 1
                        self.stats.errors = [*self.stats.errors[-9:], result.error or str(result.status)]
                if not result.ok:
                    self._stop.wait(0.5)

    def __enter__(self) -> LoadGenerator:
        if not self._workers:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
