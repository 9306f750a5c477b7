"""LmConfig: the type registry, draccus decoding of YAML model configs, axes, and checkpointing names."""

import dataclasses
from typing import Any

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
import yaml

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis


@dataclasses.dataclass(frozen=True)
class AppConfig:
    model: lm.LmConfig = dataclasses.field(default_factory=lm.Gpt2Config)


def decode(text: str) -> AppConfig:
    return draccus.decode(AppConfig, yaml.safe_load(text))


def test_registry_knows_every_family():
    known = lm.LmConfig.get_known_choices()
    assert {"gpt2", "llama", "mpt", "backpack"} <= set(known)
    for name, cls in known.items():
        assert lm.LmConfig.get_choice_class(name) is cls
        assert lm.LmConfig.get_choice_name(cls) == name
        # Every subclass answers from the same registry.
        assert lm.LlamaConfig.get_choice_class(name) is cls
    assert lm.LmConfig.default_choice_name() is None
    assert lm.LlamaConfig().model_type == "llama"


def test_registry_errors_are_clear():
    with pytest.raises(KeyError, match=r"Unknown model type 'lama'.*Did you mean 'llama'"):
        lm.LmConfig.get_choice_class("lama")

    class NotRegistered(lm.Gpt2Config):
        pass

    with pytest.raises(ValueError, match="is not a registered model config"):
        lm.LmConfig.get_choice_name(NotRegistered)
    with pytest.raises(ValueError, match="already registered"):
        lm.register_model("gpt2")(NotRegistered)
    with pytest.raises(TypeError, match="Only LmConfig subclasses"):
        lm.register_model("thing")(dict)


def test_register_model_adds_a_new_type_that_draccus_decodes():
    @lm.register_model("tiny_gpt2_for_test")
    @dataclasses.dataclass(frozen=True)
    class TinyGpt2(lm.Gpt2Config):
        pass

    try:
        config = decode("model: {type: tiny_gpt2_for_test, hidden_dim: 64, num_heads: 2}")
        assert type(config.model) is TinyGpt2 and config.model.hidden_dim == 64
    finally:
        lm.LmConfig.unregister("tiny_gpt2_for_test")


def test_lm_config_is_a_draccus_choice_type():
    assert issubclass(lm.LmConfig, draccus.choice_types.ChoiceType)


def test_draccus_decodes_each_family_from_levanter_style_yaml():
    gpt2 = decode(
        """
model:
  type: gpt2
  seq_len: 64
  hidden_dim: 32
  num_layers: 2
  num_heads: 4
  gradient_checkpointing: false
  scale_attn_by_inverse_layer_idx: true
"""
    ).model
    assert gpt2 == lm.Gpt2Config(
        seq_len=64,
        hidden_dim=32,
        num_layers=2,
        num_heads=4,
        gradient_checkpointing=False,
        scale_attn_by_inverse_layer_idx=True,
    )
    llama = decode(
        """
model:
  type: llama
  hidden_dim: 64
  intermediate_dim: 96
  num_heads: 4
  num_kv_heads: 2
  tie_word_embeddings: true
  gradient_checkpointing: nested
  rope: {type: llama3, theta: 500000.0, factor: 8.0, original_max_position_embeddings: 8192}
"""
    ).model
    assert isinstance(llama, lm.LlamaConfig) and llama.num_kv_heads == 2 and llama.tie_word_embeddings
    assert llama.rope == lm.RopeConfig(type="llama3", theta=500000.0, factor=8.0)
    assert llama.gradient_checkpointing == "nested"
    mpt = decode("model: {type: mpt, hidden_dim: 32, num_heads: 4, clip_qkv: 8.0, alibi_bias_max: 8}").model
    assert isinstance(mpt, lm.MptConfig) and mpt.clip_qkv == 8.0
    backpack = decode("model: {type: backpack, hidden_dim: 32, num_heads: 4, num_senses: 4}").model
    assert isinstance(backpack, lm.BackpackConfig) and backpack.num_senses == 4


def test_draccus_round_trips_a_config():
    config = AppConfig(lm.LlamaConfig(hidden_dim=64, num_heads=4, num_kv_heads=1, rope=lm.RopeConfig(theta=1e6)))
    encoded = draccus.encode(config)
    assert encoded["model"]["type"] == "llama"
    assert draccus.decode(AppConfig, encoded) == config


def test_unknown_model_type_fails_in_draccus():
    with pytest.raises(Exception, match="lama"):
        decode("model: {type: lama, hidden_dim: 32}")


def test_configs_expose_their_axes():
    c = lm.LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=3, num_heads=4, num_kv_heads=2)
    assert (c.Pos, c.KeyPos, c.Embed) == (Axis("position", 16), Axis("key_position", 16), Axis("embed", 32))
    assert (c.Heads, c.KVHeads, c.HeadSize) == (Axis("heads", 4), Axis("kv_heads", 2), Axis("head_size", 8))
    assert (c.Mlp, c.Layers) == (Axis("mlp", 48), Axis("layers", 3))
    g = lm.Gpt2Config(hidden_dim=32, num_heads=4, mlp_scale=3)
    assert g.Mlp == Axis("mlp", 96) and g.KVHeads == Axis("kv_heads", 4)
    assert lm.MptConfig(hidden_dim=32, num_heads=4, expansion_ratio=2).Mlp == Axis("mlp", 64)
    assert lm.MptConfig(hidden_dim=32, num_heads=4, intermediate_dim=50).Mlp == Axis("mlp", 50)


@pytest.mark.parametrize(
    ("setting", "policy"),
    [(True, "full"), (False, "none"), ("save_block_outputs", "save_block_outputs"), ("nested", "nested")],
)
def test_gradient_checkpointing_settings_reach_the_layer_stack(setting, policy):
    config = lm.Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2, gradient_checkpointing=setting)
    model = config.build(Axis("vocab", 16), key=jax.random.key(0))
    assert model.blocks.gradient_checkpointing == policy


def test_configs_are_frozen_and_hashable():
    config = lm.LlamaConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_dim = 8
    assert hash(config) == hash(lm.LlamaConfig())


class _CountingStack(eqx.Module):
    """Delegates to a layer stack and counts the model's scan() calls through it."""

    stack: Any
    calls: list = eqx.field(static=True)

    def scan(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs.get("inference"))
        return self.stack.scan(*args, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_runs_the_layer_stack_it_is_given(family):
    config = {
        "llama": lm.LlamaConfig(
            seq_len=8, hidden_dim=16, intermediate_dim=24, num_layers=2, num_heads=2, num_kv_heads=1
        ),
        "gpt2": lm.Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2),
    }[family]
    model = config.build(Axis("vocab", 16), key=jax.random.key(0))
    assert model.layer_stack() is model.blocks
    calls: list = []
    swapped = model.with_layer_stack(_CountingStack(model.layer_stack(), calls))
    ids = nt.named(jnp.arange(8).reshape(1, 8) % 16, ("batch", "position"))
    assert jnp.array_equal(swapped(ids).array, model(ids).array)
    assert len(calls) == 1  # the whole stack, once, between the embedding and the head


def test_a_model_without_a_layer_stack_says_so():
    model = lm.MptConfig(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2).build(
        Axis("vocab", 16), key=jax.random.key(0)
    )
    assert model.layer_stack() is None
    with pytest.raises(TypeError, match="exposes no layer stack"):
        model.with_layer_stack(None)
