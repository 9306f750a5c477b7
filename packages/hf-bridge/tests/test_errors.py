"""Bad input gets one clear HfBridgeError naming the file or key and the fix; nothing is unpickled or lost."""

import json
import shutil
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_bridge
from hf_bridge import HfBridgeError, hf_config_to_ours
from lm_models import LlamaConfig, MptConfig

LLAMA = {
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vocab_size": 10,
}


@pytest.fixture(scope="module")
def saved(tiny_gpt2, tmp_path_factory):
    """A valid GPT-2 checkpoint directory to copy and damage."""
    path = tmp_path_factory.mktemp("ckpt") / "gpt2"
    hf_bridge.save_pretrained(*tiny_gpt2, path)
    return path


@pytest.fixture
def copy(saved, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def _rewrite_weights(directory, change):
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_pickled_checkpoint_is_refused_with_a_conversion_hint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(HfBridgeError, match=r"never unpickles.*safetensors"):
        hf_bridge.load_pretrained(tmp_path)


def test_unknown_rope_scaling_type_is_an_error():
    hf = {**LLAMA, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    with pytest.raises(
        HfBridgeError, match=r"rope type 'longrope'.*\['default', 'linear', 'dynamic', 'llama3', 'yarn'\]"
    ):
        hf_config_to_ours(hf)


def test_unknown_rope_field_is_an_error_not_dropped():
    hf = {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "attention_factor": 0.5}}
    with pytest.raises(HfBridgeError, match="attention_factor"):
        hf_config_to_ours(hf)


def test_unknown_config_key_is_an_error_naming_it():
    with pytest.raises(HfBridgeError, match=r"'sliding_window'"):
        hf_config_to_ours({**LLAMA, "sliding_window": 128})


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"model_type": "bert"}, r"model_type='bert'.*supported"),
        ({"head_dim": 4}, r"head_dim=4"),
        ({"attention_bias": True}, r"mlp_bias"),
        ({"hidden_act": "swiglu2"}, r"hidden_act='swiglu2'"),
        ({"num_key_value_heads": 3}, r"num_kv_heads=3 does not divide"),
        ({"quantization_config": {"bits": 4}}, r"quantization_config"),
    ],
)
def test_unsupported_llama_configs(change, pattern):
    with pytest.raises(HfBridgeError, match=pattern):
        hf_config_to_ours({**LLAMA, **change})


def test_transformers_5_rope_parameters_and_legacy_keys_agree():
    new = hf_config_to_ours({**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    old = hf_config_to_ours({**LLAMA, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert isinstance(new, LlamaConfig) and new == old and new.rope.theta == 5e5


def test_gpt2_configs_that_cannot_be_represented():
    base = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 4, "vocab_size": 5}
    with pytest.raises(HfBridgeError, match="n_inner"):
        hf_config_to_ours({**base, "n_inner": 12})
    with pytest.raises(HfBridgeError, match="tie_word_embeddings"):
        hf_config_to_ours({**base, "tie_word_embeddings": False})
    with pytest.raises(HfBridgeError, match="no 'n_head'"):
        hf_config_to_ours({k: v for k, v in base.items() if k != "n_head"})


def test_mpt_configs_that_transformers_cannot_represent_are_not_exported():
    with pytest.raises(HfBridgeError, match="expansion_ratio=4"):
        hf_bridge.our_config_to_hf(MptConfig(hidden_dim=8, num_heads=2, num_layers=1, expansion_ratio=2), 10)
    with pytest.raises(HfBridgeError, match="alibi_bias_max=8"):
        hf_bridge.our_config_to_hf(MptConfig(hidden_dim=8, num_heads=2, num_layers=1, alibi_bias_max=4.0), 10)
    with pytest.raises(HfBridgeError, match="prefix_lm"):
        hf_config_to_ours({"model_type": "mpt", "d_model": 8, "n_heads": 2, "n_layers": 1, "vocab_size": 9,
                           "attn_config": {"prefix_lm": True}})  # fmt: skip


def test_missing_tensor_is_named(copy):
    _rewrite_weights(copy, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(HfBridgeError, match=r"no tensor 'transformer.h.1.mlp.c_fc.bias'"):
        hf_bridge.load_pretrained(copy)


def test_wrong_shape_is_named(copy):
    def change(t):
        t["transformer.h.0.attn.c_proj.weight"] = t["transformer.h.0.attn.c_proj.weight"][:, :-1].copy()

    _rewrite_weights(copy, change)
    with pytest.raises(HfBridgeError, match=r"'transformer.h.0.attn.c_proj.weight' has shape \(24, 23\).*\(24, 24\)"):
        hf_bridge.load_pretrained(copy)


def test_integer_weights_are_refused(copy):
    def change(t):
        t["transformer.ln_f.bias"] = t["transformer.ln_f.bias"].astype(np.int8)

    _rewrite_weights(copy, change)
    with pytest.raises(HfBridgeError, match=r"'transformer.ln_f.bias'.*dtype I8"):
        hf_bridge.load_pretrained(copy)


def test_unexpected_tensor_is_named(copy):
    _rewrite_weights(copy, lambda t: t.update({"transformer.h.9.ln_1.weight": np.ones(24, np.float32)}))
    with pytest.raises(HfBridgeError, match=r"'transformer.h.9.ln_1.weight'.*not part of a GPT2LMHeadModel"):
        hf_bridge.load_pretrained(copy)


def test_old_gpt2_checkpoints_without_prefix_and_with_mask_buffers_load(copy, tiny_gpt2):
    def change(t):
        for key in list(t):
            t[key.removeprefix("transformer.")] = t.pop(key)
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 12, 12), np.float32))

    _rewrite_weights(copy, change)
    model, _ = hf_bridge.load_pretrained(copy)
    np.testing.assert_array_equal(np.asarray(model.ln_f.weight.array), np.asarray(tiny_gpt2[0].ln_f.weight.array))


def test_broken_index_and_config_files_are_named(copy):
    (copy / "config.json").write_text("{not json")
    with pytest.raises(HfBridgeError, match=r"config.json is not valid JSON"):
        hf_bridge.load_pretrained(copy)


def test_index_pointing_to_a_missing_shard(copy):
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "model-00002-of-00002.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HfBridgeError, match=r"model-00002-of-00002.safetensors.*incomplete"):
        hf_bridge.load_pretrained(copy)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(HfBridgeError, match="does not exist"):
        hf_bridge.load_pretrained(tmp_path / "nope")


def test_hub_id_offline_fails_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(HfBridgeError, match=r"not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        hf_bridge.load_pretrained("some-org/some-model")
    assert time.monotonic() - start < 10


def test_hub_id_without_hub_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(HfBridgeError, match=r"hf-bridge\[hub\]"):
        hf_bridge.load_tokenizer("gpt2")


def test_save_never_clobbers_without_overwrite(tiny_gpt2, copy):
    model, config = tiny_gpt2
    before = (copy / "model.safetensors").read_bytes()
    with pytest.raises(HfBridgeError, match="overwrite=True"):
        hf_bridge.save_pretrained(model, config, copy)
    assert (copy / "model.safetensors").read_bytes() == before
    (copy / "stale.txt").write_text("old export")
    hf_bridge.save_pretrained(model, config, copy, overwrite=True, dtype="float16")
    assert not (copy / "stale.txt").exists()
    assert sorted(p.name for p in copy.parent.iterdir()) == ["copy"]


def test_a_bad_save_argument_leaves_the_old_export(tiny_gpt2, copy):
    # A full disk during the save is tested for real, on a small tmpfs, in test_faults.py.
    model, config = tiny_gpt2
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    with pytest.raises(HfBridgeError, match="max_shard_size"):
        hf_bridge.save_pretrained(model, config, copy, overwrite=True, max_shard_size="lots")
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert sorted(p.name for p in copy.parent.iterdir()) == ["copy"]


def test_load_weights_refuses_a_config_that_changes_the_math(tiny_gpt2, saved):
    import dataclasses

    model, config = tiny_gpt2
    other = dataclasses.replace(config, layer_norm_epsilon=1e-3)
    with pytest.raises(HfBridgeError, match=r"layer_norm_epsilon=1e-05 but the model config has layer_norm_epsilon"):
        hf_bridge.load_weights(saved, other, model.Vocab)
    with pytest.raises(HfBridgeError, match="needs the Vocab"):
        hf_bridge.load_weights(saved, config)


def test_save_refuses_a_config_that_does_not_describe_the_model(tiny_gpt2, tmp_path):
    import dataclasses

    model, config = tiny_gpt2
    with pytest.raises(
        HfBridgeError, match=r"model.config gives seq_len=12 but the config given to save has seq_len=8"
    ):
        hf_bridge.save_pretrained(model, dataclasses.replace(config, seq_len=8), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_dtype_arguments_must_be_floating(tiny_gpt2, saved, tmp_path):
    model, config = tiny_gpt2
    with pytest.raises(HfBridgeError, match=r"dtype='int8' is not a floating-point type"):
        hf_bridge.save_pretrained(model, config, tmp_path / "x", dtype="int8")
    with pytest.raises(HfBridgeError, match=r"dtype='complex64' is not"):
        hf_bridge.load_pretrained(saved, dtype="complex64")
