"""The serving engine at the GPT-2 nano shape: continuous batching against the same requests one at a time, its
decoding against `lm-train sample`'s contiguous-cache decoding at batch 1, and its pages against a contiguous cache.

Then a load test over HTTP (bench/serve_load.py): --load-clients streaming openai clients at once against the same
engine behind the server, with tokens/s, time to first token and inter-token latency percentiles.

Prints four JSON lines. Run: `uv run python bench/serve.py` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import emit, log

import lm_models as lm
import named_tensors as nt
from lm_train.serve.engine import Engine, EngineConfig
from lm_train.serve.params import SamplingParams


def words(ids: list[int]) -> str:
    """The text of token ids, one word per token (the benchmark's model has no tokenizer)."""
    return "".join(f" t{i}" for i in ids)


def requests_of(count: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs of mixed lengths."""
    rng = np.random.default_rng(seed)
    return [
        ([int(t) for t in rng.integers(1, vocab, int(rng.integers(4, 48)))], int(rng.integers(8, 48)))
        for _ in range(count)
    ]


def serve_all(engine: Engine, requests: list, together: bool) -> tuple[float, int]:
    """Seconds to serve every request (all submitted at once, or one after another) and the tokens generated."""
    start, tokens = time.perf_counter(), 0
    batches = [requests] if together else [[r] for r in requests]
    for batch in batches:
        handles = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p, n in batch]
        while not all(h.done for h in handles):
            engine.step()
        tokens += sum(len(h.wait()[0].tokens) for h in handles)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrent", type=int, default=32, help="requests served together")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded at batch 1")
    parser.add_argument("--repeats", type=int, default=5, help="batch-1 decoding runs of each (the best counts)")
    parser.add_argument("--decode-steps", type=int, default=16, help="tokens per row and decode call (EngineConfig)")
    parser.add_argument("--load-clients", type=int, default=64, help="streaming clients of the load test")
    args = parser.parse_args()
    config = lm.Gpt2Config(seq_len=128, hidden_dim=128, num_layers=4, num_heads=4)
    Vocab = nt.Axis("vocab", 512)
    model = lm.inference_mode(config.build(Vocab, key=jax.random.key(0)))
    bounds = EngineConfig(page_size=16, num_pages=1 + args.concurrent * 8, max_seqs=args.concurrent, prefill_rows=4,
                          prefill_chunk=64, decode_steps=args.decode_steps)  # fmt: skip
    engine = Engine(model, bounds, decode=words)
    warm = requests_of(2, 1, Vocab.size)
    serve_all(engine, warm, together=True)  # compiles both programs
    requests = requests_of(args.concurrent, 0, Vocab.size)
    batched_s, batched_tokens = serve_all(engine, requests, together=True)
    alone_s, alone_tokens = serve_all(engine, requests, together=False)
    assert batched_tokens == alone_tokens
    log(f"{args.concurrent} together: {batched_s:.2f} s; one at a time: {alone_s:.2f} s")
    emit(
        "serve.continuous_batching",
        {"concurrent": args.concurrent, "tokens": batched_tokens, "tokens_per_s": batched_tokens / batched_s},
        reference={"one_at_a_time_tokens_per_s": alone_tokens / alone_s},
        ratio=alone_s / batched_s,
        ratio_means="tokens/s of the requests served together / served one at a time by the same engine; aim >= 8",
    )

    # Decoding at batch 1: the engine's steps against lm_models.generate (lm-train sample), both compiled first.
    prompt = requests_of(1, 2, Vocab.size)[0][0][:8]
    n = args.decode_tokens
    ids = nt.named(jnp.asarray(prompt, jnp.int32), ("position",))
    # An engine of one row, as `lm-train sample` decodes one sequence; its pool holds that sequence.
    single = Engine(model, EngineConfig(page_size=16, num_pages=1 + 8, max_seqs=1, prefill_rows=1, prefill_chunk=64,
                                        decode_steps=args.decode_steps))  # fmt: skip
    lm.generate(model, ids, n, temperature=0.0).array.block_until_ready()
    serve_all(single, [(prompt, n)], together=True)
    # Best of --repeats, alternating the two: one run of 64 tokens lasts tens of ms, where a shared machine's
    # noise is as large.
    contiguous_s = paged_s = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        lm.generate(model, ids, n, temperature=0.0).array.block_until_ready()
        contiguous_s = min(contiguous_s, time.perf_counter() - start)
        paged_s = min(paged_s, serve_all(single, [(prompt, n)], together=True)[0])
    emit(
        "serve.decode_batch1",
        {"tokens": n, "tokens_per_s": n / paged_s},
        reference={"sample_tokens_per_s": n / contiguous_s},
        ratio=contiguous_s / paged_s,
        ratio_means="decode tokens/s at batch 1: the engine (one row, paged) / lm_models.generate (lm-train sample's "
        "contiguous cache, one compiled loop); aim >= 0.9",
    )

    # Memory: the pages that the mixed batch holds at its peak against a contiguous cache of seq_len per row.
    handles = [engine.submit(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)) for p, m in requests]
    # Every row of a contiguous cache holds seq_len positions; the pool, the pages the sequences have reached.
    peak = 0
    while not all(h.done for h in handles):
        engine.step()
        peak = max(peak, engine.pool.in_use)
    page_bytes = 2 * config.num_layers * 16 * config.hidden_dim * 4
    contiguous_bytes = 2 * config.num_layers * args.concurrent * config.seq_len * config.hidden_dim * 4
    emit(
        "serve.memory",
        {"peak_pages": peak, "paged_bytes": peak * page_bytes},
        reference={"contiguous_bytes": contiguous_bytes},
        ratio=contiguous_bytes / (peak * page_bytes),
        ratio_means="bytes of a contiguous cache of seq_len per request / bytes of the pages in use at the peak",
    )

    if args.load_clients > 0:
        report = load_over_http(engine, args.load_clients, Vocab.size)
        emit(
            "serve.load",
            report,
            reference={"in_process_tokens_per_s": batched_tokens / batched_s},
            ratio=report["tokens_per_s"] / (batched_tokens / batched_s),
            ratio_means="tokens/s of the streaming clients over HTTP / the same engine's continuous batching "
            "in-process (no HTTP); time to first token and inter-token latency of the clients in ms",
        )


def load_over_http(engine: Engine, clients: int, vocab: int) -> dict:
    """The load test against `engine` behind the server (uvicorn in a thread of this process) on localhost."""
    import socket
    import threading

    import uvicorn
    from serve_load import load_test, mixed_jobs

    from lm_train.serve.server import ServedModel, build_app

    served = ServedModel("nano", lambda text: [], words, lambda messages: [])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        jobs = mixed_jobs(clients, seed=0, vocab=vocab, prompt_range=(4, 48), output_range=(8, 48))
        report = load_test(f"http://127.0.0.1:{port}/v1", "none", "nano", jobs, timeout_s=600)
    finally:
        server.should_exit = True
        thread.join()
    if report["mismatches"]:
        raise SystemExit(f"streamed text differs from the non-streamed text for jobs {report['mismatches']}")
    log(
        f"{clients} streaming clients: {report['tokens_per_s']:.0f} tokens/s, "
        f"TTFT p50 {report['ttft']['p50_ms']:.0f} ms"
    )
    return {k: v for k, v in report.items() if k != "mismatches"}


if __name__ == "__main__":
    main()
