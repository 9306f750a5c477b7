"""A load test of a running `lm-train serve`: many concurrent streaming clients (the official openai client, on
asyncio) with mixed prompt and output lengths; each stream's text against the same seeded request's non-streamed
text, and the throughput, time to first token and inter-token latency percentiles.

Used by bench/serve.py (full size) and tests-integration/test_serve.py (small); it imports no jax.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Job:
    """One client's request: token ids of the prompt, tokens to generate and the seed of its sampler."""

    prompt: list[int]
    max_tokens: int
    seed: int


@dataclass
class Streamed:
    """What one streaming client saw: the text, the completion tokens (from usage), the finish reason, the time to
    the first text and the gaps between the chunks that carried text after it."""

    text: str
    tokens: int
    finish_reason: str | None
    first_s: float
    gaps_s: list[float]


def mixed_jobs(count: int, seed: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int]):
    """`count` jobs whose prompt and output lengths are drawn uniformly from the (inclusive) ranges."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(count):
        length = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        prompt = [int(t) for t in rng.integers(0, vocab, length)]
        jobs.append(Job(prompt, int(rng.integers(output_range[0], output_range[1] + 1)), seed * 1000 + i))
    return jobs


def _ask(job: Job, model: str) -> dict:
    # Sampled (not greedy), so that a lost, repeated or misordered token shows as different text; eos ignored, so
    # that the lengths stay mixed as drawn.
    return dict(model=model, prompt=job.prompt, max_tokens=job.max_tokens, temperature=1.0, seed=job.seed,
                extra_body={"ignore_eos": True})  # fmt: skip


async def _stream_one(client, job: Job, model: str) -> Streamed:
    start = time.perf_counter()
    stream = await client.completions.create(**_ask(job, model), stream=True, stream_options={"include_usage": True})
    pieces, stamps, tokens, reason = [], [], 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.text:
                pieces.append(choice.text)
                stamps.append(time.perf_counter())
            reason = choice.finish_reason or reason
    first = (stamps[0] if stamps else time.perf_counter()) - start
    return Streamed("".join(pieces), tokens, reason, first, list(np.diff(stamps)))


async def _whole_one(client, job: Job, model: str) -> tuple[str, int]:
    out = await client.completions.create(**_ask(job, model))
    return out.choices[0].text, out.usage.completion_tokens


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90 and p99 in milliseconds (0 for no values)."""
    if not values:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    p50, p90, p99 = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99)}


async def _run(base_url: str, api_key: str, model: str, jobs: list[Job], timeout_s: float):
    import httpx
    import openai

    limits = httpx.Limits(max_connections=len(jobs), max_keepalive_connections=len(jobs))
    http = httpx.AsyncClient(limits=limits, timeout=timeout_s)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http) as client:
        start = time.perf_counter()
        streamed = await asyncio.wait_for(asyncio.gather(*(_stream_one(client, job, model) for job in jobs)), timeout_s)
        wall = time.perf_counter() - start
        whole = await asyncio.wait_for(asyncio.gather(*(_whole_one(client, job, model) for job in jobs)), timeout_s)
    return streamed, whole, wall


def load_test(base_url: str, api_key: str, model: str, jobs: list[Job], timeout_s: float = 120.0) -> dict:
    """Stream every job at once, then ask each again without streaming; the report, with `mismatches`: the jobs
    whose streamed text or token count differ from the non-streamed answer (lost, repeated or reordered tokens)."""
    streamed, whole, wall = asyncio.run(_run(base_url, api_key, model, jobs, timeout_s))
    tokens = sum(s.tokens for s in streamed)
    mismatches = [
        i
        for i, (s, (text, count)) in enumerate(zip(streamed, whole, strict=True))
        if s.text != text or s.tokens != count or s.tokens != jobs[i].max_tokens or s.finish_reason != "length"
    ]
    return {
        "clients": len(jobs),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft": percentiles([s.first_s for s in streamed]),
        "itl": percentiles([g for s in streamed for g in s.gaps_s]),
        "mismatches": mismatches,
    }
