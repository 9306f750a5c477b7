"""Each family module carries its Hugging Face mapping as plain data, found through the config registry."""

import dataclasses
import subprocess
import sys

import pytest

import lm_models as lm
from lm_models.decoder_hf import LLAMA_NORMS, decoder_mapping
from lm_models.mistral import mistral_from_hf, mistral_to_hf

FAMILY_TYPES = {
    "gpt2", "llama", "mpt", "backpack", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma",
    "gemma2", "gemma3", "olmo2",
}  # fmt: skip


def test_every_built_in_family_declares_its_mapping_with_its_own_hf_model_type():
    families = lm.hf_families()
    assert set(families) >= FAMILY_TYPES
    for name, (cls, mapping) in families.items():
        assert lm.LmConfig.get_choice_class(name) is cls
        assert isinstance(mapping, lm.HfMapping)
    model_types = [mapping.hf_model_type for _, mapping in families.values()]
    assert len(model_types) == len(set(model_types))
    assert families["gemma3"][1].hf_model_type == "gemma3_text"


def test_a_subclass_does_not_inherit_its_parents_mapping():
    @lm.LmConfig.register_subclass("mistral_without_mapping_for_test")
    @dataclasses.dataclass(frozen=True)
    class Unmapped(lm.MistralConfig):
        pass

    try:
        assert "mistral_without_mapping_for_test" not in lm.hf_families()
        assert lm.hf_families()["mixtral"][1] is not lm.hf_families()["mistral"][1]
    finally:
        lm.LmConfig.unregister("mistral_without_mapping_for_test")


def test_two_families_claiming_one_hf_model_type_is_a_clear_error():
    @lm.LmConfig.register_subclass("second_mistral_for_test")
    @dataclasses.dataclass(frozen=True)
    class SecondMistral(lm.MistralConfig):
        pass

    SecondMistral.hf_mapping = decoder_mapping("mistral", "X", mistral_from_hf, mistral_to_hf, LLAMA_NORMS)
    try:
        with pytest.raises(ValueError, match="'mistral' and 'second_mistral_for_test' both map to Hugging Face"):
            lm.hf_families()
    finally:
        lm.LmConfig.unregister("second_mistral_for_test")


def test_the_mapping_reads_every_key_and_names_the_one_it_cannot_use():
    hf = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2}
    kwargs = lm.hf_families()["mistral"][1].config_from_hf({**hf, "sliding_window": 3}, "x/config.json")
    assert lm.MistralConfig(**kwargs) == lm.MistralConfig(
        seq_len=2048, hidden_dim=16, intermediate_dim=24, num_layers=2, num_heads=2, num_kv_heads=2, sliding_window=3
    )
    with pytest.raises(lm.HfConfigError, match=r"x/config.json has the key 'made_up_key'"):
        lm.hf_families()["mistral"][1].config_from_hf({**hf, "made_up_key": 1}, "x/config.json")


def test_the_mappings_need_no_hf_bridge_safetensors_torch_or_jax():
    code = (
        "import sys, lm_models\n"
        "for cls, m in lm_models.hf_families().values():\n"
        "    assert m.tensors(cls())\n"
        "print(sorted(n for n in ('hf_bridge', 'safetensors', 'torch', 'jax') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
