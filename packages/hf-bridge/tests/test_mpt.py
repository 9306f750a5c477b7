"""MPT against transformers: ALiBi (power-of-two and other head counts), clip_qkv, odd sizes, and the MLP that
transformers builds at 4 x d_model whatever expansion_ratio says."""

import json

import pytest

import hf_bridge

CASES = {
    "even": dict(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=16),
    "odd": dict(
        d_model=30,
        n_heads=6,
        n_layers=3,
        vocab_size=47,
        max_seq_len=13,
        attn_config={"clip_qkv": 0.05},
        expansion_ratio=3,
    ),
}


@pytest.mark.parametrize("size", list(CASES))
def test_logits_match_both_directions(hf, parity, ids_for, tmp_path, size):
    hf_config = hf.transformers.MptConfig(**CASES[size])
    theirs = parity.random_hf_model(hf, hf_config)
    theirs.save_pretrained(tmp_path / "hf")
    ids = ids_for(hf_config.vocab_size, hf_config.max_seq_len)
    expected = parity.hf_logits(hf, theirs, ids)

    model, config = hf_bridge.load_pretrained(tmp_path / "hf")
    assert config.model_type == "mpt" and config.clip_qkv == hf_config.attn_config.clip_qkv
    # transformers' MptMLP is 4 x d_model even where config.json says expansion_ratio: 3; so is the import.
    assert config.expansion_ratio == 4 and config.Mlp.size == 4 * hf_config.d_model
    parity.assert_close(parity.our_logits(model, ids), expected)

    hf_bridge.save_pretrained(model, config, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["expansion_ratio"] == 4
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    parity.assert_close(parity.hf_logits(hf, back, ids), expected)
