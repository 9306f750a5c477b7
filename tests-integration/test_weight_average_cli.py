"""End to end with the real CLI: a run that keeps an average of its weights (EMA), skips steps and follows a
batch-size schedule resumes bitwise, and its checkpoint's tools (export-hf, sample, eval, serve's loader) read
that average."""

from __future__ import annotations

import numpy as np
import pytest

import dist_ckpt
import trackers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ema_run(tiny_project, cli):
    """A run with a weight average (beta 0.9), skipped steps and a batch-size schedule: (its config, its run
    directory, the run's output)."""
    text = tiny_project.config.read_text(encoding="utf-8").replace(
        "trainer:\n", "trainer:\n  model_averaging: {type: ema, beta: 0.9}\n", 1
    )
    text = text.replace(
        "  train_batch_size: 8\n",
        "  train_batch_size: [{start: 0, value: 8}, {start: 8, value: 12}]\n  allow_nondivisible_batch_size: true\n",
    )
    # sigma_factor 0: a step whose gradient norm is above the median of the last four is skipped.
    text += "  skip_bad_steps: {rolling_interval_length: 4, sigma_factor: 0.0}\n"
    config = tiny_project.write_config("ema_skip.yaml", text)
    whole = tiny_project.root / "runs" / "ema-skip"
    first = cli(["run", str(config), "--trainer.run_dir", str(whole)], tiny_project.root)
    assert first.returncode == 0, first.output[-5000:]
    return config, whole, first


def test_a_run_with_an_ema_skipped_steps_and_a_batch_size_schedule_resumes_bitwise(tiny_project, ema_run, cli):
    """The weight average and the window of gradient norms are state: a run resumed from its step-6 checkpoint
    skips the same steps and ends with the same bits, in every leaf of the state, as the run never stopped. Its
    batches are 8 examples, then 12 from step 8, padded to 16 rows over the 8 devices: the resumed run crosses the
    change (which examples each step reads is checked against pyarrow in test_one_data_path.py)."""
    import shutil

    config, whole, first = ema_run
    assert "(8 sequences of 32, batch 8 from step 0, 12 from step 8)" in first.output
    assert "batch size 12 from step 9 (the schedule's start 8)" in first.output

    resumed = tiny_project.root / "runs" / "ema-skip-resumed"
    shutil.copytree(whole / "checkpoints" / "step-6", resumed / "checkpoints" / "step-6")
    second = cli(["run", str(config), "--trainer.run_dir", str(resumed)], tiny_project.root)
    assert second.returncode == 0, second.output[-5000:]
    assert f"resuming from {resumed / 'checkpoints' / 'step-6'}" in second.output

    left, right = (dist_ckpt.load(d / "checkpoints" / "step-12", progress=False) for d in (whole, resumed))
    assert left.keys() == right.keys()
    assert any(k.startswith(".averaged") for k in left) and any(k.startswith(".skip_window") for k in left)
    for key in left:
        assert np.asarray(left[key]).tobytes() == np.asarray(right[key]).tobytes(), f"{key} differs after resume"
    rows = trackers.read_jsonl(whole / "metrics.jsonl")
    skipped = [r["optim/skipped_steps"] for r in rows if "optim/skipped_steps" in r]
    assert 0 < skipped[-1] < 12, skipped  # some steps were skipped, and not all
    again = trackers.read_jsonl(resumed / "metrics.jsonl")
    later = [
        (r["step"], r["train/loss"], r["optim/skipped_steps"]) for r in rows if "train/loss" in r and r["step"] > 6
    ]
    assert later == [(r["step"], r["train/loss"], r["optim/skipped_steps"]) for r in again if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [6, 12] and all(r["eval/ema/loss"] != r["eval/loss"] for r in evals)


def _gpt2_tensors(tree: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """A GPT-2 checkpoint tree (flat, as the dist-ckpt reader gives it) as Hugging Face's GPT-2 tensors, in plain
    numpy: layers unstacked, heads flattened, linears as Conv1D's (in, out)."""
    leaf = {k.removeprefix(prefix).split("[")[0]: v for k, v in tree.items() if k.startswith(prefix + ".")}
    out = {
        "transformer.wte.weight": leaf[".token_embeddings.weight"],
        "transformer.wpe.weight": leaf[".position_embeddings.weight"],
        "transformer.ln_f.weight": leaf[".ln_f.weight"],
        "transformer.ln_f.bias": leaf[".ln_f.bias"],
    }
    block = {k.removeprefix(".blocks.stacked."): v for k, v in leaf.items() if k.startswith(".blocks.stacked.")}
    for i in range(block["ln_1.weight"].shape[0]):
        h = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            out[h + norm + ".weight"], out[h + norm + ".bias"] = block[norm + ".weight"][i], block[norm + ".bias"][i]
        qkv = [block[f"attn.{p}_proj.weight"][i] for p in "qkv"]  # (heads, head_size, embed)
        out[h + "attn.c_attn.weight"] = np.concatenate([w.reshape(-1, w.shape[-1]).T for w in qkv], axis=1)
        out[h + "attn.c_attn.bias"] = np.concatenate([block[f"attn.{p}_proj.bias"][i].reshape(-1) for p in "qkv"])
        o = block["attn.o_proj.weight"][i]  # (embed, heads, head_size)
        out[h + "attn.c_proj.weight"] = o.reshape(o.shape[0], -1).T
        out[h + "attn.c_proj.bias"] = block["attn.o_proj.bias"][i]
        out[h + "mlp.c_fc.weight"], out[h + "mlp.c_fc.bias"] = block["mlp.up.weight"][i].T, block["mlp.up.bias"][i]
        out[h + "mlp.c_proj.weight"] = block["mlp.down.weight"][i].T
        out[h + "mlp.c_proj.bias"] = block["mlp.down.bias"][i]
    return out


def test_export_sample_and_eval_of_a_checkpoint_use_its_weight_average(tiny_project, ema_run, cli, tmp_path):
    """`export-hf` (by default: the run's choice, its average), `sample --weights ema|raw`, serve's loader and `eval`
    of an EMA run's checkpoint: the export holds the checkpoint's average bit for bit, read with the dist-ckpt
    reader and laid out as GPT-2 in numpy; samples of the average equal those drawn in-test from that export and
    differ from the raw weights'; `eval` of the average gives the eval/ema/loss the run logged
    (test_model_averaging.py has the choice's rules and errors)."""
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    import hf_bridge
    import named_tensors as nt
    import shard_cache
    from lm_models import generate
    from lm_train.errors import UserError
    from lm_train.serve.source import load_source

    config, whole, _ = ema_run
    checkpoint = whole / "checkpoints" / "step-12"
    out = tmp_path / "ema-export"
    exported = cli(["export-hf", str(checkpoint), str(out)], tiny_project.root)
    assert exported.returncode == 0, exported.output[-5000:]
    assert "ema weights" in exported.stdout
    tree = dist_ckpt.load(checkpoint, progress=False)
    wanted, raw = _gpt2_tensors(tree, ".averaged"), _gpt2_tensors(tree, ".model")
    got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert got.keys() == wanted.keys()
    for name, value in got.items():
        assert value.dtype == wanted[name].dtype and value.tobytes() == wanted[name].tobytes(), name
    assert any(raw[k].tobytes() != wanted[k].tobytes() for k in wanted)  # the average is not the weights

    # At temperature 0.3 (seed 1) the two sets of weights sample apart from the second token on; greedy decoding
    # of this barely trained model repeats one token with either.
    args = ["sample", str(checkpoint), "--prompt", "import json", "--temperature", "0.3", "--seed", "1"]
    samples = {}
    for weights in ("ema", "raw"):
        result = cli([*args, "--max-new-tokens", "12", "--weights", weights], tiny_project.root)
        assert result.returncode == 0, result.output[-5000:]
        samples[weights] = result.stdout.removesuffix("\n")
    assert samples["ema"] != samples["raw"]
    average, _ = hf_bridge.load_pretrained(out)  # the export: the average, as checked bitwise above
    tokenizer = shard_cache.load_tokenizer(str(whole / "tokenizer.json"))
    prompt = nt.named(jnp.asarray(tokenizer.encode("import json", add_special_tokens=False).ids), ("position",))
    tokens = generate(average, prompt, 12, temperature=0.3, key=jax.random.key(1))
    assert samples["ema"] == tokenizer.decode([int(t) for t in tokens.array.tolist()])

    # serve loads its source through load_source: the average, or a clear error for an export's one set.
    served = load_source(str(checkpoint), weights="ema")
    embeddings = np.asarray(served.model.token_embeddings.weight.array)
    assert embeddings.tobytes() == wanted["transformer.wte.weight"].tobytes()
    with pytest.raises(UserError, match="is a Hugging Face export, which holds one set of weights"):
        load_source(str(out), weights="raw")

    # eval picks the run's choice too (the average), and its loss is the one the run logged as eval/ema/loss.
    evaluated = cli(["eval", str(config), "--trainer.run_dir", str(whole)], tiny_project.root)
    assert evaluated.returncode == 0, evaluated.output[-5000:]
    assert "(ema weights)" in evaluated.stdout
    logged = [r for r in trackers.read_jsonl(whole / "metrics.jsonl") if "eval/ema/loss" in r][-1]["eval/ema/loss"]
    line = next(line for line in evaluated.stdout.splitlines() if line.startswith("eval/loss"))
    assert float(line.split()[1]) == pytest.approx(logged, abs=1e-3)
