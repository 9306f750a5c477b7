"""`lm-train serve` on a tiny Hugging Face export, driven by the official openai client: completions, chat,
streaming, n > 1, seeds, logprobs, errors in OpenAI's shape; and the served log-probs equal the ones training
computes for the same tokens (the scorer of `lm-train viz` and the harness)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

import hf_bridge
import lm_models as lm
import named_tensors as nt
from conftest import free_port

KEY = "test-key"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "then",
    "it",
    "ran",
    "far",
    "away",
    "from",
    "home",
    "to",
    "see",
    "the",
    "sea",
    "under",
    "blue",
    "sky",
]


def _export(root):
    """A tiny Llama with a trained byte-level BPE tokenizer and a ChatML template, as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    tokenizer.train_from_iterator([" ".join(rng.choice(WORDS, 12)) for _ in range(200)], trainer)
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    config = lm.LlamaConfig(seq_len=96, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = config.build(nt.Axis("vocab", tokenizer.get_vocab_size()), key=jax.random.key(5))
    out = root / "tiny-llama"
    hf_bridge.save_pretrained(model, config, out, tokenizer=str(tok_dir / "tokenizer.json"))
    settings = {"eos_token": "<|im_end|>", "chat_template": CHATML}
    (out / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return out


def _start_server(lm_train_command, model_dir, log_path, flags):
    """`lm-train serve model_dir` in a subprocess, once /health answers; (process, base URL, its log file)."""
    port = free_port()
    log = open(log_path, "w+")  # noqa: SIM115 (read when the server stops)
    process = subprocess.Popen(
        [*lm_train_command, "serve", str(model_dir), "--port", str(port), *flags, "--api-key", KEY],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url, log
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            log.seek(0)
            pytest.fail(f"the server did not start:\n{log.read()[-4000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory, lm_train_command):
    """`lm-train serve` in a subprocess, started once for the module; (base URL, model directory)."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = _export(root)
    flags = ["--max-pages", "64", "--page-size", "8", "--max-seqs", "4", "--prefill-chunk", "16"]
    process, url, log = _start_server(lm_train_command, model_dir, root / "server.log", flags)
    yield url, model_dir
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
    log.seek(0)
    assert code == 0, log.read()[-4000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def test_models_completions_and_usage(client):
    (card,) = client.models.list().data
    assert card.id == "tiny-llama"
    out = client.completions.create(model="tiny-llama", prompt="the cat sat", max_tokens=6, temperature=0)
    (choice,) = out.choices
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    # Greedy is greedy: the same again, and the first tokens of a longer request.
    again = client.completions.create(model="tiny-llama", prompt="the cat sat", max_tokens=6, temperature=0)
    assert again.choices[0].text == choice.text


def test_streaming_gives_the_same_text_as_one_response(client):
    whole = client.completions.create(model="tiny-llama", prompt="a mat and", max_tokens=10, temperature=0)
    stream = client.completions.create(
        model="tiny-llama", prompt="a mat and", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "the sea"}], max_tokens=5, temperature=0,
        stream=True,
    )  # fmt: skip
    pieces = list(chat)
    assert pieces[0].choices[0].delta.role == "assistant"
    streamed = "".join(p.choices[0].delta.content or "" for p in pieces)
    once = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "the sea"}], max_tokens=5, temperature=0
    )
    assert streamed == once.choices[0].message.content and once.choices[0].message.role == "assistant"


def test_seeded_requests_reproduce_and_n_choices_differ(client):
    ask = dict(model="tiny-llama", prompt="far away", max_tokens=8, temperature=1.0, seed=42, n=3)
    first = client.completions.create(**ask)
    second = client.completions.create(**ask)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1


def test_chat_logprobs_in_openai_shape(client):
    out = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "blue sky"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_bad_requests_get_openai_errors(server, client):
    url = server[0]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, temperature=7)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="the sea " * 40, max_tokens=50)
    assert "context" in e.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens="many")
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "wizard", "content": "hi"}])
    headers = {"Authorization": f"Bearer {KEY}"}
    broken = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=headers)
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    wrong_key = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
    assert wrong_key.status_code == 401 and wrong_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/nothing", headers=headers).status_code == 404
    # Still serving.
    assert client.completions.create(model="tiny-llama", prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_served_logprobs_equal_the_training_scorer(server, client):
    import jmp

    from lm_train.tools.token_scoring import next_token_scores

    prompts = ["the cat sat on", "under blue sky the sea and a mat"]
    # Several prompts in one request: batched in the engine; sampled, so the tokens are not all the argmax.
    out = client.completions.create(
        model="tiny-llama", prompt=prompts, max_tokens=12, temperature=1.0, seed=3, logprobs=2, echo=True,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    model, _ = hf_bridge.load_pretrained(server[1])
    tokenizer = hf_bridge.load_tokenizer(server[1])
    policy = jmp.get_policy("f32")
    for p, choice in zip(prompts, sorted(out.choices, key=lambda c: c.index), strict=True):
        prompt_ids = tokenizer.encode(p, add_special_tokens=False).ids
        # The echoed prompt's tokens then the completion's; the first has no log-prob, as in OpenAI's API.
        assert choice.text.startswith(p)
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(prompt_ids) + 12
        served = choice.logprobs.token_logprobs[1:]
        ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        assert ids[: len(prompt_ids)] == prompt_ids
        padded = np.zeros((1, 96), np.int32)
        padded[0, : len(ids)] = ids
        targets = np.zeros((1, 96), np.int32)
        targets[0, : len(ids) - 1] = ids[1:]
        scores, _ = next_token_scores(
            model, nt.named(jnp.asarray(padded), ("batch", "position")), jnp.asarray(targets), policy
        )
        expected = np.asarray(scores)[0, : len(ids) - 1]
        np.testing.assert_allclose(served, expected, atol=1e-5, rtol=0)


def test_greedy_output_equals_lm_train_sample_and_transformers_generate(server, client):
    """The server's greedy tokens against lm_models.generate (what `lm-train sample` runs, on its contiguous cache)
    and transformers' generate on the same export."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("transformers")
    import torch
    import transformers

    model_dir = server[1]
    prompts = [[5, 77, 31, 190], [12, 9, 250, 3, 3, 64, 101, 17, 88, 42, 7]]
    new = 16
    out = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=new, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip
    served = [
        [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
        for c in sorted(out.choices, key=lambda c: c.index)
    ]
    model, _ = hf_bridge.load_pretrained(model_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, served, strict=True):
        sampled = lm.generate(model, nt.named(jnp.asarray(prompt, jnp.int32), ("position",)), new, temperature=0.0)
        ours = [int(t) for t in np.asarray(sampled.array)[len(prompt) :]]
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                        do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
        assert tokens == ours == theirs


def test_a_lora_adapter_is_served_merged_into_the_weights(server, tmp_path):
    """`lm-train serve SOURCE --lora DIR` loads through load_source(lora=...): its greedy tokens, from the engine,
    equal lm_models.generate on the model with the same adapters merged, and differ from the base model's."""
    from lm_train.serve.engine import Engine, EngineConfig
    from lm_train.serve.params import SamplingParams
    from lm_train.serve.source import load_source

    model_dir = server[1]
    base, config = hf_bridge.load_pretrained(model_dir)
    lora = nt.nn.apply_lora(base, nt.nn.LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "mlp.down"]),
                            key=jax.random.key(2))  # fmt: skip
    rng = np.random.default_rng(2)
    lora = jax.tree_util.tree_map_with_path(
        lambda path, leaf: nt.NamedArray(jnp.asarray(rng.normal(0, 0.5, leaf.array.shape), leaf.dtype), leaf.axes)
        if nt.path_str(path).endswith("lora_b") else leaf,
        lora, is_leaf=nt.is_named,
    )  # fmt: skip
    hf_bridge.save_peft_adapter(lora, config, tmp_path / "adapter", base_model_name_or_path=str(model_dir))
    served = load_source(str(model_dir), lora=str(tmp_path / "adapter"))
    engine = Engine(served.model, EngineConfig(page_size=8, num_pages=8, max_seqs=1), eos_token_id=None)
    prompt, new = [5, 77, 31, 190, 12], 12
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=new, temperature=0.0))[0]

    def greedy(model):
        ids = lm.generate(model, nt.named(jnp.asarray(prompt, jnp.int32), ("position",)), new, temperature=0.0)
        return [int(t) for t in np.asarray(ids.array)[len(prompt) :]]

    assert out.tokens == greedy(nt.nn.merge_lora(lora)) != greedy(base)


def _serve_load():
    """bench/serve_load.py (the load test that bench/serve.py runs at full size), loaded by path."""
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parents[1] / "bench" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_64_streaming_clients_lose_no_token_and_give_back_every_page(server):
    url, model_dir = server
    load = _serve_load()
    vocab = hf_bridge.load_tokenizer(model_dir).get_vocab_size()
    jobs = load.mixed_jobs(64, seed=1, vocab=vocab, prompt_range=(2, 24), output_range=(4, 32))
    report = load.load_test(f"{url}/v1", KEY, "tiny-llama", jobs, timeout_s=120)
    print(json.dumps(report))  # tokens/s, time to first token and inter-token latency (shown with -s or -rP)
    # Each stream's text equals the same seeded request asked without streaming, with every token asked for.
    assert report["mismatches"] == [] and report["tokens"] == sum(j.max_tokens for j in jobs)
    assert 0 < report["ttft"]["p50_ms"] <= report["ttft"]["p99_ms"] <= report["wall_s"] * 1e3
    assert 0 < report["itl"]["p50_ms"] <= report["itl"]["p99_ms"]
    health = httpx.get(f"{url}/health").json()
    assert health["pages_free"] == health["pages_capacity"] == 63
    assert health["pages_in_use"] == health["pages_reserved"] == health["running"] == health["waiting"] == 0


def test_a_full_server_answers_429_and_sigterm_lets_the_requests_in_flight_finish(server, lm_train_command, tmp_path):
    """A second, small server: one sequence at a time and one request waiting; then SIGTERM while two stream."""
    # --graceful-stop: longer than the two streams need to finish.
    flags = ["--max-pages", "16", "--page-size", "8", "--max-seqs", "1", "--max-concurrent", "1",
             "--prefill-chunk", "16", "--graceful-stop", "20"]  # fmt: skip
    process, url, log = _start_server(lm_train_command, server[1], tmp_path / "small.log", flags)
    try:
        small = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        ask = dict(model="tiny-llama", prompt="the cat", max_tokens=80, temperature=0, extra_body={"ignore_eos": True})
        assert small.completions.create(**{**ask, "max_tokens": 2}).usage.completion_tokens == 2  # compiled

        def outcome(_):
            try:
                return small.completions.create(**ask).usage.completion_tokens
            except openai.RateLimitError as e:
                return e

        # Eight at once: one decodes, one waits, the rest are refused until those are done.
        with ThreadPoolExecutor(8) as threads:
            outcomes = list(threads.map(outcome, range(8)))
        refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
        assert refused and all(o == 80 for o in outcomes if not isinstance(o, openai.RateLimitError))
        for e in refused:
            assert e.status_code == 429 and e.response.headers["retry-after"] == "1"
            assert e.body["type"] == "rate_limit_error" and e.body["code"] == "server_busy"

        # A stream's headers come once its request is queued: both are in flight (one decoding, one waiting).
        streams = [small.completions.create(**ask, stream=True, stream_options={"include_usage": True})
                   for _ in range(2)]  # fmt: skip
        process.send_signal(signal.SIGTERM)
        for stream in streams:
            chunks = list(stream)
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            # Finished, or cancelled by a long shutdown: either way a whole response, with its usage.
            assert reasons in (["length"], ["cancelled"]) and chunks[-1].usage is not None
            assert reasons == ["cancelled"] or chunks[-1].usage.completion_tokens == 80
        assert process.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.seek(0)
        server_log = log.read()
    assert "Traceback" not in server_log, server_log[-4000:]


TASK = """task: tiny_words_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
num_fewshot: 0
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
metadata:
  version: 1.0
"""


def test_lm_eval_local_completions_scores_a_task_as_the_training_scorer(server, tmp_path, monkeypatch):
    """lm-eval's own OpenAI-API model, with the server's tokenizer endpoints; each log-likelihood it gets equals
    the training scorer's for the same tokens (lm-eval's own split of context and continuation)."""
    import jmp
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from lm_train.tools.harness.runner import evaluate_tasks
    from lm_train.tools.token_scoring import next_token_scores

    url, model_dir = server
    docs = [
        {"context": "the cat sat on", "choices": [" a mat", " the sea", " blue sky far away"], "gold": 0},
        {"context": "it ran far", "choices": [" away", " home to see"], "gold": 0},
        {"context": "under blue", "choices": [" sky", " sea", " cat"], "gold": 0},
    ]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (tasks / "tiny_words_mc.yaml").write_text(TASK.format(data=json.dumps(str(tasks / "docs.jsonl"))), encoding="utf-8")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions", model="tiny-llama", tokenizer_backend="remote", auth_token=KEY,
        max_length=96, num_concurrent=2, batch_size=1,
    )  # fmt: skip
    results = evaluate_tasks(lm, ["tiny_words_mc"], tasks_dir=tmp_path / "builtin", include_path=str(tasks),
                             log_samples=True)  # fmt: skip
    samples = results["samples"]["tiny_words_mc"]
    assert len(samples) == len(docs) and 0.0 <= results["results"]["tiny_words_mc"]["acc,none"] <= 1.0
    model, _ = hf_bridge.load_pretrained(model_dir)
    policy = jmp.get_policy("f32")
    checked = 0
    for sample in samples:
        # Each request's arguments (context, continuation), and its responses: [(log-likelihood, is_greedy)].
        for (context, continuation), responses in zip(sample["arguments"], sample["resps"], strict=True):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            padded, targets = np.zeros((1, 96), np.int32), np.zeros((1, 96), np.int32)
            padded[0, : len(ids)], targets[0, : len(ids) - 1] = ids, ids[1:]
            named = nt.named(jnp.asarray(padded), ("batch", "position"))
            scores, _ = next_token_scores(model, named, jnp.asarray(targets), policy)
            expected = float(np.asarray(scores)[0, len(context_ids) - 1 : len(ids) - 1].sum())
            assert responses[0][0] == pytest.approx(expected, abs=1e-4)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in docs)


def test_bad_serve_flags_and_sources_are_clear_errors(cli, tmp_path):
    from cli_checks import assert_clear_error

    # Checked before any model is read: the folder need not even exist.
    assert_clear_error(cli(["serve", str(tmp_path / "missing"), "--max-pages", "1"], tmp_path), "--max-pages", "2")
    assert_clear_error(cli(["serve", str(tmp_path / "missing"), "--graceful-stop", "-1"], tmp_path), "--graceful-stop",
                       ">= 0")  # fmt: skip
    assert_clear_error(cli(["serve", str(tmp_path / "missing")], tmp_path), "No complete checkpoint")
    assert_clear_error(cli(["serve", str(tmp_path / "missing"), "--lora", str(tmp_path)], tmp_path), "--lora",
                       "adapter_config.json")  # fmt: skip
