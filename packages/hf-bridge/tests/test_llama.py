"""Llama against transformers: GQA, rope scaling (default/linear/llama3), tied and untied heads, odd sizes."""

import json

import pytest

import hf_bridge

SIZES = {
    "even": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64),
    "odd": dict(hidden_size=36, intermediate_size=50, num_hidden_layers=3, num_attention_heads=6, vocab_size=53),
}
ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
}
CASES = [
    ("even", 2, "default", False, False),
    ("even", 1, "linear", True, False),
    ("odd", 3, "llama3", False, False),
    ("odd", 2, "llama3", True, True),
]


@pytest.mark.parametrize(("size", "kv_heads", "rope", "tied", "bias"), CASES)
def test_logits_match_both_directions(hf, parity, ids_for, tmp_path, size, kv_heads, rope, tied, bias):
    hf_config = hf.transformers.LlamaConfig(
        **SIZES[size],
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        rope_theta=500.0,
        rope_scaling=ROPE[rope],
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        attention_bias=bias,
        mlp_bias=bias,
    )
    theirs = parity.random_hf_model(hf, hf_config)
    theirs.save_pretrained(tmp_path / "hf")
    ids = ids_for(hf_config.vocab_size, 19 if size == "odd" else 16)
    expected = parity.hf_logits(hf, theirs, ids)

    model, config = hf_bridge.load_pretrained(tmp_path / "hf")
    assert (config.num_kv_heads, config.rope.type, config.tie_word_embeddings) == (kv_heads, rope, tied)
    assert config.use_bias == bias
    assert (model.lm_head is None) == tied
    parity.assert_close(parity.our_logits(model, ids), expected)

    hf_bridge.save_pretrained(model, config, tmp_path / "ours")
    index = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert index["tie_word_embeddings"] == tied
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    parity.assert_close(parity.hf_logits(hf, back, ids), expected)
