"""GPT-2 against transformers: logits both ways, sharded checkpoints, tied weights, dtypes, layouts."""

import json

import numpy as np
import pytest
from safetensors import safe_open

import hf_bridge
from lm_models import unstack_layers

SIZES = {
    "even": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16),
    "odd": dict(n_embd=21, n_layer=3, n_head=3, vocab_size=51, n_positions=13, n_inner=63),
}


def gpt2_config(hf, size: str, **extra):
    return hf.transformers.GPT2Config(**SIZES[size], bos_token_id=0, eos_token_id=0, **extra)


@pytest.mark.parametrize("size", ["even", "odd"])
def test_logits_match_both_directions(hf, parity, ids_for, size, tmp_path):
    theirs = parity.random_hf_model(hf, gpt2_config(hf, size, scale_attn_by_inverse_layer_idx=size == "odd"))
    theirs.save_pretrained(tmp_path / "hf")
    ids = ids_for(theirs.config.vocab_size, theirs.config.n_positions)
    expected = parity.hf_logits(hf, theirs, ids)

    model, config = hf_bridge.load_pretrained(tmp_path / "hf")
    assert config.model_type == "gpt2" and model.Vocab.size == theirs.config.vocab_size
    parity.assert_close(parity.our_logits(model, ids), expected)

    hf_bridge.save_pretrained(model, config, tmp_path / "ours")
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    parity.assert_close(parity.hf_logits(hf, back, ids), expected)


def test_unrolled_layers_load_and_save_like_scanned(hf, parity, ids_for, tmp_path):
    theirs = parity.random_hf_model(hf, gpt2_config(hf, "odd"))
    theirs.save_pretrained(tmp_path / "hf")
    ids = ids_for(51, 9)
    expected = parity.hf_logits(hf, theirs, ids)
    model, config = hf_bridge.load_pretrained(tmp_path / "hf", config_overrides={"scan_layers": False})
    assert not config.scan_layers
    parity.assert_close(parity.our_logits(model, ids), expected)
    hf_bridge.save_pretrained(model, config, tmp_path / "ours")
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    parity.assert_close(parity.hf_logits(hf, back, ids), expected)


def test_sharded_checkpoints_both_ways(hf, parity, ids_for, tmp_path):
    theirs = parity.random_hf_model(hf, gpt2_config(hf, "even"))
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids = ids_for(64, 16)
    expected = parity.hf_logits(hf, theirs, ids)
    model, config = hf_bridge.load_pretrained(tmp_path / "hf")
    parity.assert_close(parity.our_logits(model, ids), expected)

    hf_bridge.save_pretrained(model, config, tmp_path / "ours", max_shard_size="20KB")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "ours" / "model.safetensors").exists()
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    parity.assert_close(parity.hf_logits(hf, back, ids), expected)
    again, _ = hf_bridge.load_pretrained(tmp_path / "ours")
    parity.assert_close(parity.our_logits(again, ids), expected)


def test_tied_head_is_written_once_and_layout_is_conv1d(tiny_gpt2, tmp_path):
    model, config = tiny_gpt2
    hf_bridge.save_pretrained(model, config, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        c_fc = f.get_tensor("transformer.h.0.mlp.c_fc.weight")
        metadata = f.metadata()
    assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys
    # Conv1D stores (in, out): embed rows, mlp columns.
    assert c_fc.shape == (config.hidden_dim, config.hidden_dim * config.mlp_scale)
    np.testing.assert_array_equal(c_fc, np.asarray(model.blocks.stacked.mlp.up.weight.array[0]).T)
    assert metadata == {"format": "pt"}


def test_bfloat16_export_and_dtype_on_load(tiny_gpt2, tmp_path):
    model, config = tiny_gpt2
    hf_bridge.save_pretrained(model, config, tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("transformer.wte.weight").get_dtype() == "BF16"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, _ = hf_bridge.load_pretrained(tmp_path / "bf16")
    assert loaded.token_embeddings.weight.dtype == np.float32
    as_bf16, _ = hf_bridge.load_pretrained(tmp_path / "bf16", dtype="bfloat16")
    assert as_bf16.token_embeddings.weight.dtype.name == "bfloat16"
    np.testing.assert_array_equal(
        np.asarray(as_bf16.token_embeddings.weight.array, np.float32),
        np.asarray(model.token_embeddings.weight.array.astype("bfloat16"), np.float32),
    )


def test_round_trip_ours_files_ours_is_exact(tiny_gpt2, tmp_path):
    model, config = tiny_gpt2
    hf_bridge.save_pretrained(model, config, tmp_path / "out", max_shard_size=4000)
    again, config_again = hf_bridge.load_pretrained(tmp_path / "out")
    assert config_again == config
    for a, b in zip(_leaves(model), _leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_weights_into_a_given_config_with_shorter_positions(tiny_gpt2, tmp_path):
    import dataclasses

    import named_tensors as nt

    model, config = tiny_gpt2
    hf_bridge.save_pretrained(model, config, tmp_path / "out")
    shorter = dataclasses.replace(config, seq_len=5, scan_layers=False, gradient_checkpointing=False)
    loaded = hf_bridge.load_weights(tmp_path / "out", shorter, model.Vocab)
    assert loaded.position_embeddings.weight.axes[0] == nt.Axis("position", 5)
    np.testing.assert_array_equal(
        np.asarray(loaded.position_embeddings.weight.array), np.asarray(model.position_embeddings.weight.array[:5])
    )
    unrolled = unstack_layers(model)
    np.testing.assert_array_equal(
        np.asarray(loaded.blocks.blocks[1].attn.k_proj.weight.array),
        np.asarray(unrolled.blocks.blocks[1].attn.k_proj.weight.array),
    )
    # Into an existing model: its structure, the checkpoint's values.
    again = hf_bridge.load_weights(tmp_path / "out", loaded)
    assert again.position_embeddings.weight.axes == loaded.position_embeddings.weight.axes


def _leaves(model):
    import jax

    return jax.tree.leaves(model)
