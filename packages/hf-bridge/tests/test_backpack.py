"""Backpack: hf_bridge's own layout round-trips ours -> files -> ours exactly, with and without biases."""

import json

import jax
import numpy as np
import pytest
from safetensors import safe_open

import hf_bridge
import named_tensors as nt
from lm_models import BackpackConfig

VOCAB = nt.Axis("vocab", 29)


@pytest.mark.parametrize(
    ("use_bias", "scan_layers", "shard"), [(True, True, "5GB"), (False, False, 3000)], ids=["bias", "nobias-sharded"]
)
def test_round_trip_is_exact(parity, ids_for, make_model, tmp_path, use_bias, scan_layers, shard):
    config = BackpackConfig(
        seq_len=11, hidden_dim=24, num_layers=2, num_heads=3, num_senses=4, use_bias=use_bias, scan_layers=scan_layers
    )
    model = make_model(config, VOCAB.size, seed=1)
    hf_bridge.save_pretrained(model, config, tmp_path / "bp", max_shard_size=shard)
    written = json.loads((tmp_path / "bp" / "config.json").read_text())
    assert written["model_type"] == "backpack" and written["num_senses"] == 4

    again, config_again = hf_bridge.load_pretrained(tmp_path / "bp", config_overrides={"scan_layers": scan_layers})
    assert config_again == config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = ids_for(VOCAB.size, 11)
    np.testing.assert_array_equal(parity.our_logits(again, ids), parity.our_logits(model, ids))


def test_layout_is_the_documented_one(make_model, tmp_path):
    config = BackpackConfig(seq_len=8, hidden_dim=16, num_layers=1, num_heads=2, num_senses=4)
    model = make_model(config, VOCAB.size)
    hf_bridge.save_pretrained(model, config, tmp_path / "bp")
    with safe_open(str(tmp_path / "bp" / "model.safetensors"), framework="numpy") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (16, 48)
    assert shapes["sense_net.final.down.weight"] == (4 * 16, 64)
    assert shapes["sense_query.weight"] == (4 * 4, 16)
    assert "lm_head.weight" not in shapes
