"""The decoder families: alternating layers under scan, flash == dense with windows and soft caps, the mixture of
experts' auxiliary losses and expert parallelism, FLOPs, config errors and Levanter's YAML model sections."""

import dataclasses
import math

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 41)
BASE = dict(seq_len=16, hidden_dim=24, intermediate_dim=20, num_layers=4, num_heads=4, num_kv_heads=2)


def _forward(model, ids):
    return np.asarray(eqx.filter_jit(lambda m, x: nt.permute(m(x), ("batch", "position", "vocab")).array)(model, ids))


def test_layers_that_differ_stay_one_scan_and_equal_the_unrolled_layers(ids_of):
    # Local and global layers with their own RoPE theta; the window is on the local layers only.
    config = lm.Gemma3Config(**BASE, head_dim=8, sliding_window=3, sliding_window_pattern=2, rope_local_base_freq=100.0)
    spec = config.decoder_spec()
    assert len(set(spec.layer_windows)) == 2  # the layers really differ
    scanned = config.build(VOCAB, key=jax.random.key(0))
    assert isinstance(scanned.blocks, nt.Stacked)
    ids = ids_of(1, vocab=VOCAB.size)
    logits = _forward(scanned, ids)
    np.testing.assert_allclose(_forward(lm.unstack_layers(scanned), ids), logits, atol=1e-6)
    # Without the per-layer differences the model computes something else: the scan does use them.
    no_windows = dataclasses.replace(scanned, config=dataclasses.replace(config, sliding_window=None))
    assert np.abs(_forward(no_windows, ids) - logits).max() > 1e-4


def test_blockwise_attention_equals_dense_with_windows_and_soft_caps(ids_of):
    config = lm.Gemma2Config(
        **BASE, head_dim=8, sliding_window=3, query_pre_attn_scalar=6, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0, gradient_checkpointing=False,
    )  # fmt: skip
    dense = config.build(VOCAB, key=jax.random.key(1))
    # The same weights (the attention choice is static), with the window and soft cap applied block by block.
    flash = dataclasses.replace(config, use_flash_attention=True, flash_attention_block_size=4)
    flash = flash.build(VOCAB, key=jax.random.key(1))
    ids = ids_of(2, vocab=VOCAB.size)
    loss = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x: lm.next_token_loss(m, x).array))
    (value, grads), (ref_value, ref_grads) = loss(flash, ids), loss(dense, ids)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6, rtol=1e-4)


MIXTRAL = lm.MixtralConfig(**BASE, n_routed_experts=4, num_experts_per_tok=2, lbl_coef=0.1, rzl_coef=0.01)


def test_experts_sharded_over_four_devices_give_the_same_loss_aux_losses_and_gradients(ids_of):
    model = MIXTRAL.build(VOCAB, key=jax.random.key(3))
    ids = ids_of(4, batch=4, vocab=VOCAB.size)

    def loss(m, x):
        total, aux = lm.next_token_loss(m, x, with_aux=True)
        return total.array, (aux, lm.next_token_loss(m, x).array)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (total, (aux, plain)), grads = grad(model, ids)
    assert set(aux) == {"router_aux_loss", "router_z_loss"}
    # The training loss is the cross-entropy plus each auxiliary loss times its configured weight.
    np.testing.assert_allclose(total, plain + 0.1 * aux["router_aux_loss"] + 0.01 * aux["router_z_loss"], rtol=1e-6)
    # k = 2 of 4 experts: balanced routing gives 2, and a fresh router is close to balanced.
    assert 1.9 < float(aux["router_aux_loss"]) < 2.6 and float(aux["router_z_loss"]) > 0

    mesh = nt.make_mesh({"data": 2, "model": 4})
    mapping = {"batch": "data", "experts": "model"}
    sharded = nt.shard_tree(model, mapping, mesh)
    gate = sharded.blocks.stacked.mlp.experts.gate
    assert gate.axis_names == ("layers", "experts", "mlp", "embed")
    assert gate.array.sharding.spec == jax.sharding.PartitionSpec(None, "model", None, None)
    with nt.axis_mapping(mapping, mesh=mesh):
        (sharded_total, (sharded_aux, _)), sharded_grads = grad(sharded, nt.shard_tree(ids))
    np.testing.assert_allclose(sharded_total, total, atol=1e-5)
    for name, value in aux.items():
        np.testing.assert_allclose(sharded_aux[name], value, atol=1e-5)
    for g, ref in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-5)


def test_families_without_auxiliary_losses_report_none(ids_of):
    dense = eqx.filter_eval_shape(lambda: lm.MistralConfig(**BASE).build(VOCAB, key=jax.random.key(2)))
    ids = ids_of(3, vocab=VOCAB.size)
    _, aux = eqx.filter_eval_shape(lambda m, x: lm.next_token_loss(m, x, with_aux=True), dense, ids)
    assert aux == {} and dense.config.aux_loss_weights() == {}
    moe = eqx.filter_eval_shape(lambda: MIXTRAL.build(VOCAB, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="reduction='mean'"):
        lm.next_token_loss(moe, ids, with_aux=True, reduction="sum")
    assert MIXTRAL.aux_loss_weights() == {"router_aux_loss": 0.1, "router_z_loss": 0.01}


def test_flops_count_only_the_active_experts():
    dense = lm.MistralConfig(**BASE)
    moe = dataclasses.replace(MIXTRAL, num_experts_per_tok=1)
    one_mlp = 3 * BASE["hidden_dim"] * BASE["intermediate_dim"] * BASE["num_layers"]
    router = BASE["hidden_dim"] * 4 * BASE["num_layers"]
    # Same attention (the Mixtral here has no window); one expert's MLP per token plus the router.
    assert moe.flops_per_token(41) - dense.flops_per_token(41) == pytest.approx(6 * router)
    two = dataclasses.replace(MIXTRAL, num_experts_per_tok=2).flops_per_token(41)
    assert two - moe.flops_per_token(41) == pytest.approx(6 * one_mlp)
    eight_experts = dataclasses.replace(MIXTRAL, n_routed_experts=8, num_experts_per_tok=2).flops_per_token(41)
    assert eight_experts - two == pytest.approx(6 * router)  # more experts, same active compute


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: lm.MistralConfig(**BASE, sliding_window=0), "sliding windows must be positive"),
        (lambda: lm.MixtralConfig(**BASE, n_routed_experts=2, num_experts_per_tok=3), "3 experts per token"),
        (lambda: lm.MixtralConfig(**BASE, lbl_coef=-1.0), "lbl_coef must be >= 0"),
        (lambda: lm.Gemma2Config(**BASE, attn_logit_softcapping=0.0), "attn_logit_softcapping must be positive"),
        (lambda: lm.Qwen3Config(**{**BASE, "hidden_dim": 26}, head_dim=None), "set head_dim"),
        (lambda: lm.Qwen3Config(**BASE, head_dim=7), "must be even"),
        (lambda: lm.GemmaConfig(**{**BASE, "num_kv_heads": 3}), "num_kv_heads=3 does not divide"),
    ],
)
def test_bad_configs_are_clear_errors(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


@dataclasses.dataclass(frozen=True)
class AppConfig:
    model: lm.LmConfig = dataclasses.field(default_factory=lm.Gpt2Config)


@pytest.mark.parametrize(
    ("section", "cls", "checks"),
    [
        ({"type": "mistral"}, lm.MistralConfig, {"hidden_dim": 4096, "num_kv_heads": 8, "sliding_window": 4096}),
        ({"type": "mixtral"}, lm.MixtralConfig, {"n_routed_experts": 8, "num_experts_per_tok": 2, "num_layers": 32}),
        ({"type": "gemma"}, lm.GemmaConfig, {"hidden_dim": 2048, "num_kv_heads": 1, "head_dim": 256}),
        ({"type": "qwen3", "head_dim": 64, "use_sliding_window": True}, lm.Qwen3Config, {"head_dim": 64}),
    ],
)
def test_levanter_model_sections_decode(section, cls, checks):
    """Levanter's mistral_7b.yaml, mixtral_8x7b.yaml and gemma_2b.yaml give just the type: our defaults are the
    7B / 8x7B / 2B models that they name."""
    config = draccus.decode(AppConfig, yaml.safe_load(yaml.safe_dump({"model": section}))).model
    assert type(config) is cls
    for name, value in checks.items():
        assert getattr(config, name) == value
    # The defaults are consistent configs that build (shapes only: nothing is allocated).
    shapes = eqx.filter_eval_shape(lambda: config.build(Axis("vocab", 32000), key=jax.random.key(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) > 1e9
    assert jnp.isfinite(config.flops_per_token(32000))
