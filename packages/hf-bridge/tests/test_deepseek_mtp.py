"""DeepSeek-V3's multi-token prediction modules in Hugging Face checkpoints, against the safetensors files read with
the plain safetensors library (transformers skips these tensors, so it cannot be the reference for them).

The layout is DeepSeek-V3's release (its README_WEIGHTS.md): MTP depth i is layer num_hidden_layers + i, with
enorm, hnorm, eh_proj, shared_head.norm, a decoder layer, and copies of the embedding and the head.
"""

import json

import jax
import numpy as np
import pytest

import hf_bridge
import lm_models
import named_tensors as nt

# Layer 0 dense, layer 1 sparse, so the two depths (layers 2 and 3) are sparse like the last layer; an untied head.
CONFIG = lm_models.DeepseekV3Config(
    seq_len=8, hidden_dim=16, intermediate_dim=12, num_layers=2, num_heads=2, q_lora_rank=6, kv_lora_rank=5,
    qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3, attention_bias=True, moe_intermediate_dim=6,
    n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, scan_layers=False,
    mtp_depth=2,
)  # fmt: skip
VOCAB = 29


@pytest.fixture(scope="module")
def exported(tmp_path_factory, make_model):
    """A random model of ours with two MTP depths, its sharded export, and the export's tensors by key."""
    from safetensors.numpy import load_file

    model = make_model(CONFIG, VOCAB, seed=5)
    path = tmp_path_factory.mktemp("mtp") / "hf"
    hf_bridge.save_pretrained(model, CONFIG, path, max_shard_size=4000)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {k: v for f in sorted(set(index.values())) for k, v in load_file(path / f).items()}
    return model, path, tensors


def _np(array: nt.NamedArray, *axes: str) -> np.ndarray:
    return np.asarray(nt.permute(array, axes).array)


def test_mtp_depths_export_as_deepseeks_layers_and_import_bit_for_bit(exported, tmp_path):
    model, path, tensors = exported
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 2
    assert not any(k.startswith("model.layers.4.") for k in tensors)
    head = _np(model.lm_head.weight, "vocab", "embed")
    table = _np(model.embed_tokens.weight, "vocab", "embed")
    for i, depth in enumerate(model.mtp):
        h = f"model.layers.{2 + i}."
        np.testing.assert_array_equal(tensors[h + "enorm.weight"], np.asarray(depth.enorm.weight.array))
        np.testing.assert_array_equal(tensors[h + "hnorm.weight"], np.asarray(depth.hnorm.weight.array))
        np.testing.assert_array_equal(tensors[h + "shared_head.norm.weight"], np.asarray(depth.norm.weight.array))
        # (out, in) as torch's Linear, the input being [enorm(embedding); hnorm(hidden)].
        np.testing.assert_array_equal(tensors[h + "eh_proj.weight"], _np(depth.eh_proj.weight, "embed", "mtp_input"))
        assert tensors[h + "eh_proj.weight"].shape == (16, 32)
        np.testing.assert_array_equal(tensors[h + "shared_head.head.weight"], head)
        np.testing.assert_array_equal(tensors[h + "embed_tokens.weight"], table)
        block = depth.block
        np.testing.assert_array_equal(
            tensors[h + "input_layernorm.weight"], np.asarray(block.pre_attn_norm.weight.array)
        )
        fused = tensors[h + "self_attn.kv_a_proj_with_mqa.weight"]  # the latent's 5 rows, then the rope key's 2
        np.testing.assert_array_equal(fused[:5], _np(block.self_attn.kv_a_proj.weight, "kv_lora", "embed"))
        np.testing.assert_array_equal(fused[5:], _np(block.self_attn.k_rope_proj.weight, "qk_rope", "embed"))
        experts = _np(block.mlp.experts.gate, "experts", "mlp", "embed")
        np.testing.assert_array_equal(tensors[h + "mlp.experts.3.gate_proj.weight"], experts[3])
        np.testing.assert_array_equal(
            tensors[h + "mlp.gate.e_score_correction_bias"], np.asarray(block.mlp.correction_bias.array)
        )
    # No two depths (nor a depth and the main model) were written from the same arrays.
    assert not np.array_equal(tensors["model.layers.2.enorm.weight"], tensors["model.layers.3.enorm.weight"])
    assert not np.array_equal(tensors["model.layers.1.mlp.gate.weight"], tensors["model.layers.2.mlp.gate.weight"])

    loaded, config = hf_bridge.load_pretrained(path, config_overrides={"mtp_depth": 2})
    assert config == CONFIG
    for ours, back in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(back))

    # mtp_depth below the checkpoint's: the depths it asks for; 0 (config.json's reading): the main model alone.
    one, _ = hf_bridge.load_pretrained(path, config_overrides={"mtp_depth": 1})
    main, main_config = hf_bridge.load_pretrained(path)
    assert len(one.mtp) == 1 and main.mtp == () and main_config.mtp_depth == 0
    for ours, back in zip(jax.tree.leaves(model.mtp[0]), jax.tree.leaves(one.mtp[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(back))
    plain_leaves = jax.tree.leaves(main)
    assert len(plain_leaves) == len(jax.tree.leaves(model)) - len(jax.tree.leaves(model.mtp))
    np.testing.assert_array_equal(np.asarray(main.lm_head.weight.array), np.asarray(model.lm_head.weight.array))

    # A checkpoint without them (the main model's export, like transformers') and mtp_depth >= 1: a clear error.
    hf_bridge.save_pretrained(main, main_config, tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with pytest.raises(hf_bridge.HfBridgeError, match=r"no tensor 'model.layers.2.enorm.weight'.*model.mtp_depth=1 "):
        hf_bridge.load_pretrained(tmp_path / "plain", config_overrides={"mtp_depth": 1})


def test_transformers_loads_an_export_with_mtp_depths_with_the_main_models_logits(exported, hf, parity, ids_for):
    model, path, _ = exported
    theirs = hf.transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ids = ids_for(VOCAB, 7)
    parity.assert_close(parity.hf_logits(hf, theirs, ids), parity.our_logits(model, ids))
