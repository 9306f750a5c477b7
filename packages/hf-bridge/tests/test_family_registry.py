"""hf_bridge finds a family through the lm_models registry: a family declared only in lm_models converts."""

import dataclasses

import jax
import numpy as np
import pytest

import hf_bridge
import lm_models as lm
from lm_models.decoder_hf import LLAMA_NORMS, decoder_mapping
from lm_models.mistral import mistral_from_hf, mistral_to_hf
from named_tensors import Axis


@pytest.fixture
def new_family():
    """A family that exists only as an lm_models config class with its hf_mapping (no hf_bridge code)."""

    @lm.LmConfig.register_subclass("windowless_mistral_for_test")
    @dataclasses.dataclass(frozen=True)
    class WindowlessMistral(lm.MistralConfig):
        sliding_window: int | None = None

    WindowlessMistral.hf_mapping = decoder_mapping(
        "windowless_mistral", "MistralForCausalLM", mistral_from_hf, mistral_to_hf, LLAMA_NORMS
    )
    yield WindowlessMistral
    lm.LmConfig.unregister("windowless_mistral_for_test")


def test_a_family_declared_in_lm_models_round_trips_through_a_checkpoint(new_family, tmp_path):
    config = new_family(seq_len=16, hidden_dim=16, intermediate_dim=24, num_layers=2, num_heads=4, num_kv_heads=2)
    hf = hf_bridge.our_config_to_hf(config, 11)
    assert (hf["model_type"], hf["architectures"]) == ("windowless_mistral", ["MistralForCausalLM"])
    assert hf_bridge.hf_config_to_ours(hf) == config

    model = config.build(Axis("vocab", 11), key=jax.random.PRNGKey(0))
    hf_bridge.save_pretrained(model, config, tmp_path / "hf")
    loaded, loaded_config = hf_bridge.load_pretrained(tmp_path / "hf")
    assert type(loaded_config) is new_family and loaded_config == config
    for ours, theirs in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_an_unknown_model_type_names_the_known_ones_and_the_fix():
    with pytest.raises(hf_bridge.HfBridgeError, match=r"model_type='bert'.*'gemma3_text'.*hf_mapping"):
        hf_bridge.hf_config_to_ours({"model_type": "bert"}, where="x/config.json")


def test_a_mapping_error_reaches_the_caller_as_hf_bridge_error():
    hf = {"model_type": "mistral", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1}
    with pytest.raises(hf_bridge.HfBridgeError, match=r"x/config.json has no 'intermediate_size'"):
        hf_bridge.hf_config_to_ours(hf, where="x/config.json")
