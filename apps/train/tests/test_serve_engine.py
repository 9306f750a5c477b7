"""The serving engine: continuous batching over a paged cache gives the tokens and log-probs of the plain full
forward; pages are accounted for and shared by common prefixes; the step compiles once per shape; a seeded request
samples the same tokens whatever shares its batch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from lm_train.serve.engine import Engine, EngineConfig
from lm_train.serve.pages import PagePool
from lm_train.serve.params import RequestError, SamplingParams

VOCAB = nt.Axis("vocab", 64)
SEQ = 48


@pytest.fixture(scope="module")
def model():
    config = lm.Gpt2Config(seq_len=SEQ, hidden_dim=32, num_layers=2, num_heads=4)
    return lm.inference_mode(config.build(VOCAB, key=jax.random.key(0)))


@pytest.fixture(scope="module")
def reference(model):
    """log_softmax of the full forward (no cache) at every position of ids (padded to SEQ)."""
    forward = eqx.filter_jit(lambda m, x: jax.nn.log_softmax(m(x).array.astype(jnp.float32), axis=-1))

    def log_probs(ids: list[int]) -> np.ndarray:
        padded = np.zeros((SEQ,), np.int32)
        padded[: len(ids)] = ids
        return np.asarray(forward(model, nt.named(jnp.asarray(padded), ("position",))))[: len(ids)]

    return log_probs


@pytest.fixture(scope="module")
def engine(model):
    # Small pages, chunks and batch, so that prompts are chunked, pages scattered and requests wait for a row; a few
    # tokens per decode call, so that a sequence outlives the steps in which others join.
    config = EngineConfig(page_size=4, num_pages=64, max_seqs=3, prefill_rows=2, prefill_chunk=8, decode_steps=4)
    return Engine(model, config, eos_token_id=None, decode=lambda ids: " ".join(f"t{i}" for i in ids))


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB.size, length)]


def _greedy(reference, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    for _ in range(new):
        row = reference(ids)[-1]
        ids.append(int(row.argmax()))
        lps.append(float(row.max()))
    return ids[len(prompt) :], lps


def test_page_pool_accounting_and_shared_prefixes():
    pool = PagePool(num_pages=8, page_size=2)
    assert pool.capacity == 7 and pool.free == 7
    assert pool.try_reserve(3) and not pool.try_reserve(5)
    a = [pool.allocate(), pool.allocate()]
    pool.register(a[0], 0, [5, 6])
    pool.register(a[1], a[0], [7, 8])
    assert 0 not in a and pool.in_use == 2 and pool.reserved == 1
    shared = pool.share_prefix([5, 6, 7, 8, 9])
    assert shared == a and [pool.refs[p] for p in a] == [2, 2]
    assert pool.share_prefix([5, 6, 1, 1]) == [a[0]]  # a different second page: only the first is shared
    pool.release([a[0]])
    pool.release(a)
    assert [pool.refs[p] for p in a] == [1, 1] and pool.in_use == 2
    pool.release(a)
    pool.unreserve(1)
    assert pool.in_use == 0 and pool.reserved == 0 and pool.share_prefix([5, 6, 7, 8, 9]) == []
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a[0]])


def test_batched_greedy_tokens_and_logprobs_equal_the_full_forward(engine, reference):
    lengths = [3, 11, 17, 5, 9]  # more requests than rows: some join the batch as others leave
    prompts = [_prompt(i, n) for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.0, logprobs=2) for i in range(len(prompts))]
    requests = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    while not all(r.done for r in requests):
        engine.step()
    for prompt, q, request in zip(prompts, params, requests, strict=True):
        (out,) = request.wait()
        tokens, lps = _greedy(reference, prompt, q.max_tokens)
        assert out.tokens == tokens and out.finish_reason == "length"
        np.testing.assert_allclose([t.logprob for t in out.logprobs], lps, atol=1e-5)
        assert [t.top[0][0] for t in out.logprobs] == tokens and all(len(t.top) == 2 for t in out.logprobs)
        assert out.text == " ".join(f"t{i}" for i in tokens)
    assert engine.pool.in_use == 0 and engine.pool.reserved == 0
    # One program for prefill chunks and one for decoding, whatever the prompts' lengths.
    assert engine.step_fn.compilations == 2


def test_common_prefixes_share_pages_and_still_decode_exactly(engine, reference):
    prefix = _prompt(7, 10)  # two whole pages of 4 shared, the rest computed per request
    prompts = [prefix + _prompt(8, 3), prefix + _prompt(9, 5)]
    # Long enough to be still decoding after the step that reads a prompt's end (and decodes a call's k tokens).
    first = engine.submit(prompts[0], SamplingParams(max_tokens=20, temperature=0.0))
    while engine.pool.in_use == 0 or any(s.prefilling for s in engine._running):
        engine.step()
    second = engine.submit(prompts[1], SamplingParams(max_tokens=20, temperature=0.0))
    engine.step()
    (a,) = [s for s in engine._running if s.request is first]
    (b,) = [s for s in engine._running if s.request is second]
    assert b.pages[:2] == a.pages[:2] and [engine.pool.refs[p] for p in a.pages[:2]] == [2, 2]
    assert b.first_computed == 8
    while not (first.done and second.done):
        engine.step()
    for prompt, request, new in zip(prompts, (first, second), (20, 20), strict=True):
        assert request.wait()[0].tokens == _greedy(reference, prompt, new)[0]
    assert engine.pool.in_use == 0 and engine.pool.reserved == 0
    assert engine.step_fn.compilations == 2


def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_full_batch(engine):
    prompt = _prompt(11, 9)
    params = SamplingParams(
        max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=1234, presence_penalty=0.5, frequency_penalty=0.3
    )
    (alone,) = engine.generate([prompt], params)[0]
    others = [
        engine.submit(_prompt(20 + i, 4 + 3 * i), SamplingParams(max_tokens=12, temperature=1.0)) for i in range(4)
    ]
    crowded = engine.submit(prompt, params)
    while not crowded.done or not all(r.done for r in others):
        engine.step()
    assert crowded.wait()[0].tokens == alone.tokens
    # n choices: each its own draw, and the same again for the same seed.
    two = engine.generate([prompt], SamplingParams(**{**params.__dict__, "n": 2}))[0]
    assert two[0].tokens == alone.tokens and two[1].tokens != alone.tokens
    assert engine.pool.in_use == 0 and engine.step_fn.compilations == 2


def test_stops_and_prompt_logprobs(engine, reference):
    prompt = _prompt(30, 6)
    greedy, _ = _greedy(reference, prompt, 8)
    by_token = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(greedy[3],)))
    assert by_token[0][0].tokens == greedy[: greedy.index(greedy[3])] and by_token[0][0].finish_reason == "stop"
    stop = f"t{greedy[2]}"
    by_text = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop=(stop,)))[0][0]
    assert stop not in by_text.text and by_text.finish_reason == "stop"
    echo = engine.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=True, logprobs=1))
    while not echo.done:
        engine.step()
    expected = reference(prompt)
    got = echo.prompt_logprobs
    assert got[0] is None and [t.token for t in got[1:]] == prompt[1:]
    np.testing.assert_allclose([t.logprob for t in got[1:]], expected[np.arange(5), prompt[1:]], atol=1e-5)
    with pytest.raises(RequestError, match="context of 48") as error:
        engine.submit(_prompt(1, 40), SamplingParams(max_tokens=9))
    assert error.value.param == "max_tokens"
    with pytest.raises(RequestError, match="temperature"):
        engine.submit(prompt, SamplingParams(temperature=3.0))
    assert engine.pool.in_use == 0 and engine.step_fn.compilations == 2


def test_a_pool_sized_by_a_share_of_free_memory_is_capped_at_full_length_sequences(model):
    from lm_train.serve.engine_config import bytes_per_page, free_device_bytes

    # keys and values x 2 layers x 4 positions x 4 heads x 8 dims x 4 bytes
    assert bytes_per_page(model.config, 4, jnp.float32) == 2 * 2 * 4 * 4 * 8 * 4
    assert free_device_bytes() > 0
    engine = Engine(model, EngineConfig(page_size=4, memory_fraction=0.01, max_seqs=2))
    # 1% of this machine's free memory holds far more: the pool stops at two sequences of SEQ positions.
    assert engine.pool.capacity == 2 * SEQ // 4


def test_decoding_k_tokens_per_call_keeps_every_promise(model, engine):
    """The engine's k-token decode calls against an engine that decodes one token per call: the same sampled
    tokens, log-probs, alternatives, stops (tokens after a stop dropped) and texts, with requests joining mid-way."""
    decode = engine.decode
    one = Engine(model, EngineConfig(page_size=4, num_pages=64, max_seqs=3, prefill_rows=2, prefill_chunk=8,
                                     decode_steps=1), decode=decode)  # fmt: skip
    assert engine.config.decode_steps == 4
    base = SamplingParams(max_tokens=20, temperature=0.9, top_k=30, seed=5, presence_penalty=0.4, logprobs=3)
    probe = one.generate([_prompt(40, 7)], base)[0][0]
    stop_token, stop_text = probe.tokens[6], f"t{probe.tokens[4]} "
    asks = [
        (_prompt(40, 7), base),
        (_prompt(41, 12), SamplingParams(**{**base.__dict__, "seed": 6, "frequency_penalty": 0.5, "n": 2})),
        (_prompt(40, 7), SamplingParams(**{**base.__dict__, "stop_token_ids": (stop_token,)})),
        (_prompt(40, 7), SamplingParams(**{**base.__dict__, "stop": (stop_text,)})),
        (_prompt(42, 3), SamplingParams(max_tokens=17, temperature=0.0, logprobs=None)),
    ]
    results = []
    for eng in (one, engine):
        handles = [eng.submit(p, q) for p, q in asks]
        while not all(h.done for h in handles):
            eng.step()
        results.append([h.wait() for h in handles])
        assert eng.pool.in_use == 0 and eng.pool.reserved == 0
    for ones, many in zip(*results, strict=True):
        for a, b in zip(ones, many, strict=True):
            assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
            if a.logprobs is not None:
                np.testing.assert_allclose([t.logprob for t in b.logprobs], [t.logprob for t in a.logprobs], atol=1e-6)
                assert [[i for i, _ in t.top] for t in b.logprobs] == [[i for i, _ in t.top] for t in a.logprobs]
    by_token, by_text = results[1][2][0], results[1][3][0]
    assert by_token.finish_reason == "stop" and by_token.tokens == probe.tokens[: probe.tokens.index(stop_token)]
    assert by_text.finish_reason == "stop" and stop_text not in by_text.text + " " and len(by_text.tokens) < 20
    assert results[1][0][0].tokens == probe.tokens  # the seeded request, alone in `one` or with others here
    assert engine.step_fn.compilations == 2
