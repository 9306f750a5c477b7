"""PEFT LoRA adapters: what we write, peft.PeftModel loads with our logits; merged exports and reading back match."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_bridge
import lm_models
import named_tensors as nt
from named_tensors.nn import LoraConfig

LLAMA = lm_models.LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=4, num_heads=4, num_kv_heads=2)
GPT2 = lm_models.Gpt2Config(seq_len=16, hidden_dim=24, num_layers=2, num_heads=3)
VOCAB = 53


def with_random_adapters(model, config, targets, seed=1):
    """LoRA on `targets` (HF or our names) with A and B random, so that the adapters change every logit."""
    lora = nt.nn.apply_lora(
        model, LoraConfig(r=4, alpha=12.0, target_modules=hf_bridge.hf_lora_targets(config, targets)),
        key=jax.random.key(seed),
    )  # fmt: skip
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if nt.path_str(path).endswith("lora_b"):
            return nt.NamedArray(jnp.asarray(rng.normal(0, 0.2, leaf.array.shape), leaf.dtype), leaf.axes)
        return leaf

    return jax.tree_util.tree_map_with_path(fill, lora, is_leaf=nt.is_named)


def peft_logits(hf, base_dir, adapter_dir, ids):
    import peft

    base = hf.transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with hf.torch.no_grad():
        return model(hf.torch.tensor(ids)).logits.float().numpy()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
@pytest.mark.parametrize(
    ("config", "targets"),
    [(LLAMA, ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]), (GPT2, ["c_attn", "mlp.c_proj"])],
    ids=["llama", "gpt2-fused-c_attn"],
)
def test_peft_loads_our_adapter_with_our_logits(hf, parity, make_model, ids_for, tmp_path, config, targets):
    base = make_model(config, VOCAB)
    lora = with_random_adapters(base, config, targets)
    ids = ids_for(VOCAB, 11)
    ours = parity.our_logits(lora, ids)
    assert np.abs(ours - parity.our_logits(base, ids)).max() > 1e-2  # the adapters matter

    hf_bridge.save_pretrained(base, config, tmp_path / "base")
    hf_bridge.save_peft_adapter(lora, config, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 12.0 and written["peft_type"] == "LORA"
    parity.assert_close(peft_logits(hf, tmp_path / "base", tmp_path / "adapter", ids), ours)

    merged = nt.nn.merge_lora(lora)
    hf_bridge.save_pretrained(merged, config, tmp_path / "merged")
    back = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    parity.assert_close(parity.hf_logits(hf, back, ids), ours)

    loaded = hf_bridge.load_peft_adapter(tmp_path / "adapter", base)
    assert nt.nn.lora_paths(loaded) == nt.nn.lora_paths(lora)
    np.testing.assert_allclose(parity.our_logits(loaded, ids), ours, atol=1e-5)


def test_reading_back_our_llama_adapter_is_exact(make_model, tmp_path):
    base = make_model(LLAMA, VOCAB)
    lora = with_random_adapters(base, LLAMA, ["q_proj", "k_proj", "gate_proj"])
    hf_bridge.save_peft_adapter(lora, LLAMA, tmp_path / "adapter")
    loaded = hf_bridge.load_peft_adapter(tmp_path / "adapter", base)
    adapters, _ = nt.partition(lora, nt.nn.lora_params)
    again, _ = nt.partition(loaded, nt.nn.lora_params)
    for x, y in zip(nt.tree_leaves(adapters), nt.tree_leaves(again), strict=True):
        assert x.axes == y.axes
        np.testing.assert_array_equal(np.asarray(x.array), np.asarray(y.array))


def test_hf_names_map_to_ours_and_errors_are_clear(make_model, tmp_path):
    assert hf_bridge.hf_lora_targets(LLAMA, ["q_proj", "gate_proj", "mlp.down_proj"]) == [
        "self_attn.q_proj",
        "mlp.gate",
        "mlp.down",
    ]
    assert hf_bridge.hf_lora_targets(GPT2, ["c_attn", "c_proj", "up"]) == [
        "attn.q_proj",
        "attn.k_proj",
        "attn.v_proj",
        "attn.o_proj",
        "mlp.down",
        "up",
    ]
    assert hf_bridge.hf_lora_targets(LLAMA, r".*_proj") == r".*_proj"
    base = make_model(GPT2, VOCAB)
    with pytest.raises(hf_bridge.HfBridgeError, match="has no LoRA adapters"):
        hf_bridge.save_peft_adapter(base, GPT2, tmp_path / "none")
    only_q = with_random_adapters(base, GPT2, ["attn.q_proj"])
    with pytest.raises(hf_bridge.HfBridgeError, match=r"c_attn fuses .*adapt all of them"):
        hf_bridge.save_peft_adapter(only_q, GPT2, tmp_path / "q")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(hf_bridge.HfBridgeError, match="reads LORA adapters only"):
        hf_bridge.load_peft_adapter(tmp_path / "bad", base)
